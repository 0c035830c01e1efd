"""The engine server's FastAPI app: routes, OpenAI-shaped errors, auth, body limits, health, draining.

The app starts listening at once: while the engine core loads the model `/health` answers 503,
and so does every `/v1` route. `ServerState` holds what the routes share; `serve.py` owns the process
(uvicorn, signals) and calls `ServerState.drain` on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import lockstep
from lockstep_engine.api import metrics
from lockstep_engine.api.client import CoreTimeouts, EngineCoreClient
from lockstep_engine.api.errors import APIError, error_body, error_response
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
from lockstep_engine.api.serving import OpenAIServing
from lockstep_engine.config import EngineConfig
from lockstep_engine.model_config import ModelConfig
from lockstep_engine.sources import log

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_BODY_BYTES = 16 << 20
_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_idle_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    core_timeouts: CoreTimeouts = field(default_factory=CoreTimeouts)


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
        self.idle = asyncio.Event()
        self.on_fatal = None  # set by serve.py: called when the model cannot be loaded
        self._loader: asyncio.Task | None = None

    # ---- startup ----------------------------------------------------------------------------
    async def start(self) -> None:
        self.idle.set()
        self._loader = asyncio.create_task(self._load())

    async def _load(self) -> None:
        """The core resolves and loads the model, then sends its config and tokenizer over."""
        try:
            client = EngineCoreClient(self.engine_config, self.settings.core_timeouts)
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
        self.collector = metrics.register_engine(client, self.settings.served_model_names[0])
        log(f"engine core ready (pid {ready.pid}, {ready.num_blocks} KV blocks of {ready.block_size}, "
            f"num_scheduler_steps={ready.num_scheduler_steps}, max_model_len={ready.max_model_len})")

    async def stop(self) -> None:
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        if self.collector is not None:
            metrics.unregister(self.collector)
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

    def require_serving(self) -> OpenAIServing:
        reason = self.unavailable_reason()
        if reason is not None:
            raise APIError(503, reason)
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

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


class GuardMiddleware:
    """Auth for /v1, the request body limit (413), and counting generation requests in flight.

    The body is read here (as FastAPI would anyway) so an oversized one is refused before any
    parsing; the app then gets it replayed, and later `receive()` calls still see a disconnect.
    """

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        settings = self.state.settings
        if settings.api_key and path.startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {settings.api_key}":
                return await error_response(401, "invalid or missing API key (expected 'Authorization: Bearer KEY')",
                                            None, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        body, too_large = await _read_body(scope, receive, settings.max_body_bytes)
        if too_large:
            return await error_response(413, f"request body larger than {settings.max_body_bytes} bytes",
                                        None, {"Connection": "close"})(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if path not in GENERATION_PATHS or scope["method"] != "POST":
            return await self.app(scope, replay, send)
        self.state.enter()
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.leave()


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


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    lines, param = [], None
    for error in errors[:10]:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        where = ".".join(loc) or "body"
        param = param or (".".join(loc) if loc else None)
        lines.append(f"{where}: {error.get('msg', 'invalid')}")
    count = len(errors)
    return f"{count} validation error{'s' if count != 1 else ''}: " + "; ".join(lines), param


def build_app(engine_config: EngineConfig, settings: ServerSettings) -> FastAPI:
    state = ServerState(engine_config, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="Lockstep engine server", version=lockstep.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of a Lockstep engine (vLLM-compatible parameters).")
    app.state.server = state
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log(f"error: {type(exc).__name__} while serving {request.url.path}: {exc}")
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        reason = state.unavailable_reason()
        if reason is not None:
            return error_response(503, reason)
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": lockstep.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def models():
        serving = state.require_serving()
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "lockstep",
             "root": engine_config.model, "parent": None, "max_model_len": serving.config.max_model_len}
            for name in serving.served_model_names]}

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await state.require_serving().create_completion(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await state.require_serving().create_chat_completion(body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest):
        return JSONResponse(state.require_serving().tokenize(body))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        return JSONResponse(state.require_serving().detokenize(body))

    return app


__all__ = ["build_app", "ServerSettings", "ServerState", "error_body"]
