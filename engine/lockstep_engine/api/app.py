"""The engine server's FastAPI app: routes, OpenAI-shaped errors, auth, body limits, health, draining.

The app starts listening at once: while the engine core loads the model `/health` answers 503,
and so does every `/v1` route. `ServerState` holds what the routes share; `serve.py` owns the process
(uvicorn, signals) and calls `ServerState.drain` on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import traceback
from urllib.parse import parse_qsl, urlencode
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from lockstep_common.anthropic_errors import AnthropicRoutes
from lockstep_common.gc_heap import freeze_startup_heap
from lockstep_common.health_listener import request_id as listener_request_id
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from lockstep_engine import __version__
from lockstep_engine.api import anthropic, error_messages, lora, metrics, responses
from lockstep_engine.api import tokenize as token_routes
from lockstep_engine.api.body_text import undecodable_text
from lockstep_engine.api.client import CoreTimeouts, EngineCoreClient
from lockstep_engine.api.errors import (
    REQUEST_FAULT,
    RETRYABLE,
    APIError,
    error_body,
    error_response,
    refused_unstarted,
)
from lockstep_common.large_body import LARGE_BODY_BYTES, LargeBodyReader
from lockstep_engine.api.large_body import body_limits
from lockstep_engine.api.peers import ApiServerGroup, Peers
from lockstep_engine.api.openai_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from lockstep_engine.api.server_defaults import ServerDefaults
from lockstep_engine.api.serving import OpenAIServing
from lockstep_engine.config import EngineConfig
from lockstep_engine.log import log
from lockstep_engine.model_config import ModelConfig

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
DEFAULT_MAX_BODY_BYTES = 16 << 20
# A waiting request holds its prompt, not KV: as token ids in this process and in the core (a list of ints,
# about 16 bytes per byte of JSON body), plus its connection, task and per-request state. Measured with
# 10,000 at once (docs/GATEWAY.md, "Admission").
DEFAULT_QUEUED_MEMORY_BYTES = 1 << 30
QUEUED_REQUEST_OVERHEAD_BYTES = 46 << 10
HELD_BYTES_PER_BODY_BYTE = 16
_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_idle_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    core_timeouts: CoreTimeouts = field(default_factory=CoreTimeouts)
    max_queued_requests: int | None = None  # beyond --max-num-seqs; None: no count, the memory budget bounds them
    max_queued_memory_bytes: int = DEFAULT_QUEUED_MEMORY_BYTES  # what requests beyond --max-num-seqs may hold
    body_read_timeout_s: float = 60.0  # a request body must arrive within this, else 408
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice: tool_choice "auto" is allowed
    reasoning_parser: str | None = None  # --reasoning-parser: <think> text apart from the answer (api/reasoning.py)
    gpu_memory_utilization: float | None = None  # when given: on the CPU it is ignored, and the log says so
    defaults: ServerDefaults = field(default_factory=ServerDefaults)  # chat template, role, sampling defaults
    group: ApiServerGroup | None = None  # one of several API servers of one engine core (--api-server-count)
    stream_interval: int = 1  # --stream-interval: a request's tokens per wake-up of its stream (the first at once)


class ServerState:
    """Everything the routes share; `serving` is None until the model is loaded."""

    def __init__(self, engine_config: EngineConfig, settings: ServerSettings):
        self.engine_config = engine_config
        self.settings = settings
        self.client: EngineCoreClient | None = None
        self.serving: OpenAIServing | None = None
        self.collector = None
        self.load_error: str | None = None
        self.draining = False
        self.in_flight = 0
        self.held_bytes = 0  # what the generation requests in flight hold, as GuardMiddleware counts it
        self.idle = asyncio.Event()
        self.on_fatal = None  # set by serve.py: called when the model cannot be loaded
        self._loader: asyncio.Task | None = None
        self.large_bodies = LargeBodyReader()
        self.peers: Peers | None = None  # the other API servers of this engine (--api-server-count)
        # This server's share of the engine's admission limits: with N API servers each admits 1/N of them
        # (the kernel spreads connections over the servers), so the sums keep the flags' meaning.
        count = settings.group.count if settings.group is not None else 1
        self.num_seats = -(-engine_config.max_num_seqs // count)
        self.max_queued_memory_bytes = settings.max_queued_memory_bytes // count
        queued = settings.max_queued_requests
        self.max_requests = None if queued is None else self.num_seats + -(-queued // count)

    # ---- startup ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.idle.set()
        self._loader = asyncio.create_task(self._load())

    async def _load(self) -> None:
        """The core resolves and loads the model, then sends its config and tokenizer over."""
        try:
            group = self.settings.group
            client = EngineCoreClient(self.engine_config, self.settings.core_timeouts, self.max_requests,
                                      core_conn=group.core_conn if group is not None else None,
                                      stream_interval=self.settings.stream_interval)
            client.on_dead = self._core_died
            self.client = client
            await client.start()
            ready = await client.wait_ready()
            model_config = ModelConfig(**ready.model_config)
            config = self.engine_config.with_model_limits(model_config.max_position_embeddings)
        except Exception as error:  # a bad model source, a core that died while loading
            self.load_error = str(error)
            log(f"error: {error}")
            if self.on_fatal is not None:
                self.on_fatal(str(error))
            return
        self.serving = OpenAIServing(client, config, model_config, ready.tokenizer,
                                     self.settings.served_model_names, self.settings.request_idle_timeout_s)
        self.serving.tool_call_parser = self.settings.tool_call_parser
        self.serving.reasoning_parser = self.settings.reasoning_parser
        self.serving.defaults = self.settings.defaults
        self.serving.trust_request_chat_template = self.settings.trust_request_chat_template
        self.collector = metrics.register_engine(client, self.settings.served_model_names[0])
        if self.settings.group is not None:
            self.peers = Peers(self.settings.group, metrics.api_state)
            self.peers.start()
        if ready.device == "cpu" and self.settings.gpu_memory_utilization is not None:
            log(f"warning: --gpu-memory-utilization {self.settings.gpu_memory_utilization} is ignored on the CPU: "
                f"the KV cache there is --kv-cache-memory-bytes (default 2 GiB)")
        log(f"engine core ready (pid {ready.pid}, {ready.num_blocks} KV blocks of {ready.block_size}, "
            f"num_scheduler_steps={ready.num_scheduler_steps}, max_model_len={ready.max_model_len})")
        freeze_startup_heap()  # the app, the tokenizer and the imports stay: full collections skip them

    def _core_died(self, reason: str) -> None:
        """Fatal: requests in flight have failed; the process exits non-zero so its supervisor restarts it."""
        log(f"error: the engine core died ({reason}); exiting")
        if self.on_fatal is not None:
            self.on_fatal(reason)

    async def stop(self) -> None:
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        if self.peers is not None:
            self.peers.stop()
        if self.collector is not None:
            metrics.unregister(self.collector)
        if self.serving is not None and self.serving.large_text is not None:
            self.serving.large_text.shutdown()
        if self.serving is not None:
            self.serving.grammars.shutdown()
        self.large_bodies.shutdown()
        if self.client is not None:
            await self.client.shutdown()

    # ---- readiness --------------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.serving is None:
            return "the model is still loading"
        if not self.client.is_healthy:
            return f"the engine core is not available: {self.client.dead_reason}"
        return None

    def health_reason(self) -> str | None:
        """Why /health says 503: this server's reason, or another API server of this engine not serving."""
        reason = self.unavailable_reason()
        if reason is None and self.peers is not None and not self.peers.all_ready():
            return f"not every one of the {self.peers.group.count} API servers is ready"
        return reason

    def require_serving(self) -> OpenAIServing:
        reason = self.unavailable_reason()
        if reason is not None:
            raise refused_unstarted(reason)
        return self.serving

    # ---- shutdown ---------------------------------------------------------------------------
    async def drain(self) -> None:
        """Refuses new work (503) and waits for requests in flight, aborting them after the grace period."""
        self.draining = True
        log(f"draining: {self.in_flight} request(s) in flight, grace period {self.settings.shutdown_grace_s:.0f} s")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), self.settings.shutdown_grace_s)
        if self.in_flight and self.client is not None:
            log(f"grace period over: aborting {self.in_flight} request(s)")
            self.client.abort_all()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.idle.wait(), 5.0)

    def admits(self, held_bytes: int) -> bool:
        """The running batch's seats are always open; past them, requests wait while what they hold fits
        in --max-queued-memory-bytes."""
        return (self.in_flight < self.num_seats
                or self.held_bytes + held_bytes <= self.max_queued_memory_bytes)

    def enter(self, held_bytes: int = 0) -> None:
        self.in_flight += 1
        self.held_bytes += held_bytes
        self.idle.clear()

    def leave(self, held_bytes: int = 0) -> None:
        self.in_flight -= 1
        self.held_bytes -= held_bytes
        if self.in_flight == 0:
            self.idle.set()


class GuardMiddleware:
    """Request ids, auth for /v1, the request body's size (413) and read time (408), undecodable text (400),
    and counting generation requests in flight.

    The body is read here (as FastAPI would anyway) so an oversized, slow or undecodable one is refused
    before any parsing; the app then gets it replayed, and later `receive()` calls still see a disconnect.
    """

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = listener_request_id(scope["headers"])  # the health listener's too
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        return await self._guard(scope, receive, send_with_id)

    async def _guard(self, scope, receive, send):
        path = scope["path"]
        settings = self.state.settings
        if _redact_query_key(scope):
            return await error_response(400, "API keys in the query string are refused (they end up in logs); "
                                             "send 'Authorization: Bearer KEY'", "api_key")(scope, receive, send)
        authorizations = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(authorizations) > 1:  # proxies disagree on which one counts (the first, the last): neither does
            return await error_response(400, f"{len(authorizations)} Authorization headers: send exactly one",
                                        "authorization")(scope, receive, send)
        if settings.api_key and path.startswith("/v1"):
            given = authorizations[0] if authorizations else b""
            if not hmac.compare_digest(given, b"Bearer " + settings.api_key.encode()):
                return await error_response(401, "invalid or missing API key (expected 'Authorization: Bearer KEY')",
                                            None, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        try:
            body, too_large = await asyncio.wait_for(_read_body(scope, receive, settings.max_body_bytes),
                                                     settings.body_read_timeout_s)
        except asyncio.TimeoutError:
            return await error_response(408, f"the request body did not arrive within "
                                             f"{settings.body_read_timeout_s:.0f} s", None,
                                        {"Connection": "close"})(scope, receive, send)
        if too_large:
            return await error_response(413, f"request body larger than {settings.max_body_bytes} bytes",
                                        None, {"Connection": "close"})(scope, receive, send)
        bad_text = undecodable_text(body)
        if bad_text is not None:
            return await error_response(400, *bad_text)(scope, receive, send)
        if len(body) >= LARGE_BODY_BYTES and scope["method"] == "POST":
            refused = await self._large_body_refusal(body)
            if refused is not None:
                return await refused(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if path not in GENERATION_PATHS or scope["method"] != "POST":
            return await self.app(scope, replay, send)
        held = QUEUED_REQUEST_OVERHEAD_BYTES + HELD_BYTES_PER_BODY_BYTE * len(body)
        if not self.state.admits(held):
            return await error_response(
                503, f"the {self.state.in_flight} requests in this engine hold {self.state.held_bytes >> 20} MiB, and "
                     f"the limit for requests waiting beyond --max-num-seqs is "
                     f"{self.state.max_queued_memory_bytes >> 20} MiB (--max-queued-memory-bytes"
                     f"{'' if settings.group is None else f' over {settings.group.count} API servers'}); retry later",
                None,
                {**RETRYABLE, "Retry-After": "1"})(scope, receive, send)
        self.state.enter(held)
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.leave(held)

    async def _large_body_refusal(self, body: bytes) -> Response | None:
        """The answer to a large body that its sizes decide, read in a worker (large_body.py): parsed here,
        it would hold the loop for up to a second. A server that cannot serve yet answers 503 unparsed."""
        reason = self.state.unavailable_reason()
        if reason is not None:
            return error_response(503, reason, None, RETRYABLE)
        limits = body_limits(self.state.serving.config.max_model_len)
        refused = await asyncio.to_thread(self.state.large_bodies.refusal, body, limits)
        return None if refused is None else error_response(400, *refused)


def _redact_query_key(scope) -> bool:
    """Replaces an `api_key` query parameter's value (the access log prints the query) and reports it."""
    query = scope.get("query_string", b"")
    if b"key" not in query.lower():
        return False
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if not any(name.lower() in ("api_key", "api-key", "apikey", "key") for name, _ in pairs):
        return False
    scope["query_string"] = urlencode(
        [(name, "REDACTED" if name.lower() in ("api_key", "api-key", "apikey", "key") else value)
         for name, value in pairs]).encode("latin-1")
    return True


async def _read_body(scope, receive, limit: int) -> tuple[bytes, bool]:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                if int(value) > limit:
                    return b"", True
            except ValueError:
                pass
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks), False


def health_response(state: ServerState) -> Response:
    """`/health`: 200 when requests can be served, else 503 with the reason. Also built off the event loop
    (`probe_answer`), so it only reads `state`."""
    reason = state.health_reason()
    return Response(status_code=200) if reason is None else error_response(503, reason)


def probe_answer(state: ServerState) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """/health's status, headers and body before GuardMiddleware adds x-request-id, for the health listener
    (lockstep_common/health_server.py publishes it from a thread). Safe off the loop: each attribute `unavailable_reason`
    reads is one atomic read under the GIL, and a stale one is the answer of 50 ms before."""
    response = health_response(state)
    return response.status_code, response.raw_headers, response.body


def build_app(engine_config: EngineConfig, settings: ServerSettings) -> FastAPI:
    state = ServerState(engine_config, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Lockstep engine server", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of a Lockstep engine (vLLM-compatible parameters).")
    app.state.server = state
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(AnthropicRoutes)  # outside the guard: its key header and its errors on /v1/messages

    def error(request: Request, status: int, message: str, param=None, headers=None):
        if status >= 500:  # the id finds the server log's lines about it
            message = f"{message} (request id {request.state.request_id})"
        if status == 500 and state.unavailable_reason() is None:
            headers = {**(headers or {}), **REQUEST_FAULT}
        return error_response(status, message, param, headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(request, exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = error_messages.validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        return error(request, exc.status_code, error_messages.http_error_message(request, exc.status_code, str(exc.detail), headers),
                     None, headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        trace = "".join(traceback.format_exception(exc))  # for the log only, never for the client
        log(f"error: request {request.state.request_id}: {type(exc).__name__} while serving {request.url.path}:\n"
            f"{trace}")
        # Starlette raises the exception again once this answer is sent, and uvicorn then drops the
        # connection: the client is told, so it does not send its next request on a dead connection.
        return error(request, 500, f"internal error: {type(exc).__name__}", headers={"Connection": "close"})

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        return health_response(state)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        peers = await asyncio.to_thread(state.peers.others) if state.peers is not None else ()
        return Response(metrics.render(peers), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def models():
        return {"object": "list", "data": lora.model_cards(state.require_serving(), int(time.time()),
                                                            engine_config.model)}

    @app.get("/v1/models/{model_id:path}", responses=_ERROR_RESPONSES)
    async def model(model_id: str):
        card = next((c for c in lora.model_cards(state.require_serving(), int(time.time()), engine_config.model)
                     if c["id"] == model_id), None)
        if card is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return card

    @app.get("/ping", responses={503: {"model": ErrorResponse}})  # a route per method: one OpenAPI operation id each
    @app.post("/ping", responses={503: {"model": ErrorResponse}})
    async def ping():
        # vLLM's SageMaker-style liveness route: the same answer as /health.
        return await health()

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await state.require_serving().create_completion(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await state.require_serving().create_chat_completion(body, request)

    responses.register(app, state, _ERROR_RESPONSES)
    anthropic.register(app, state, _ERROR_RESPONSES)
    if engine_config.enable_lora and lora.runtime_updates_allowed():
        lora.register(app, state, _ERROR_RESPONSES)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        return JSONResponse(await asyncio.to_thread(token_routes.tokenize, state.require_serving(), body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        return JSONResponse(await asyncio.to_thread(token_routes.detokenize, state.require_serving(), body))

    return app


__all__ = ["build_app", "ServerSettings", "ServerState", "error_body", "probe_answer"]
