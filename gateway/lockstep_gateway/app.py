"""The gateway's FastAPI app: OpenAI routes in front of the engines, plus /health and /metrics.

Per request, in this order: an API key in the query string (401, any route), admission (503 +
Retry-After past `--max-in-flight` requests in progress), API key (401), body size and read time
(413, 408), JSON (400: not JSON, not UTF-8, a lone surrogate, nested too deep, not an object),
model -> pool (404 for a model no engine ever served), per-key rate limits (429 + Retry-After),
then the proxy (503 + Retry-After when no engine can take it). Every answer carries an
`x-request-id` (the client's, or one made here), which 5xx messages and log lines name; an
unexpected error is logged with its traceback and answered with the id only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import ssl
import time
import urllib.parse
import uuid

import httpx
from fastapi import FastAPI, Request
from lockstep_common.anthropic_errors import AnthropicRoutes
from lockstep_common.errors import error_body, route_not_found
from lockstep_common.gc_heap import freeze_startup_heap
from lockstep_common.large_body import LARGE_BODY_BYTES, BodyLimits, LargeBodyReader
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lockstep_gateway import __version__
from lockstep_gateway.auth import KeyChecker, QueryKeyGuard, key_id, load_keys
from lockstep_gateway.backends import Registry
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.discovery import KubeAPI, KubernetesDiscovery, watch_config_file
from lockstep_gateway.errors import GatewayError, error_response
from lockstep_gateway.metrics import CONTENT_TYPE, GatewayMetrics, engine_id
from lockstep_gateway.flow_control import PriorityTrust, disconnect_watcher, request_priority
from lockstep_gateway.health import health_response, ready_response
from lockstep_gateway.json_body import parse_json_object
from lockstep_gateway.proxy import ClientShards, Job, Proxy
from lockstep_gateway.ratelimit import ClientAddress, RateLimiter, estimate_tokens
from lockstep_gateway.relay import Relayed
from lockstep_gateway.routing.candidate import Incoming
from lockstep_gateway.upstream import UpstreamClient

log = logging.getLogger("lockstep.gateway")

# path -> route label
PROXIED_ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages_count_tokens",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
GENERATION_ROUTES = ("completions", "chat_completions", "responses", "messages")
# Routes that name no model (a stored response's id): any healthy engine answers them. path -> methods
PASSTHROUGH_ROUTES = {
    "/v1/responses/{response_id}": ("GET", "DELETE"),
    "/v1/responses/{response_id}/cancel": ("POST",),
    "/v1/responses/{response_id}/input_items": ("GET",),
}
# vLLM's routes that load and unload a LoRA adapter: an engine's, never the gateway's (a 404 that says so).
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# Answered by the gateway itself (in the OpenAPI document's spelling).
LOCAL_ROUTES = ("/v1/models", "/v1/models/{model_id}", "/health", "/ping", "/version")
UPSTREAM_CLIENT_SHARDS = 16
UPSTREAM_WRITE_TIMEOUT_S = 30.0
# Headers the engine may need; everything else (hop-by-hop, host, cookies) stays here.
FORWARDED_HEADERS = ("traceparent", "tracestate")
# The engine's largest counts (lockstep_engine.validation.MAX_PROMPTS; a guided_choice list): a large body with
# more is refused before the gateway parses it (lockstep_common/large_body.py).
MAX_PROMPTS = 1024
MAX_LIST_ITEMS = 100_000
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UNAUTHORIZED = "invalid or missing API key (send 'Authorization: Bearer KEY')"


class Gateway:
    """What the routes share."""

    def __init__(self, config: GatewayConfig, rng: random.Random | None = None):
        self.config = config
        self.metrics = GatewayMetrics()
        priority_keys = load_keys(config.priority_api_key_files, environ={})
        self.keys = KeyChecker(load_keys(config.api_key_files, config.api_keys) + priority_keys)
        self.priority_trust = PriorityTrust(map(key_id, priority_keys), config.priority_trusted_proxies)
        self.limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
        self.client_address = ClientAddress(config.trusted_proxies)
        timeout = httpx.Timeout(connect=config.connect_timeout_s, read=None, write=UPSTREAM_WRITE_TIMEOUT_S, pool=None)
        tls = ssl.create_default_context()  # one for every client: each costs ~0.15 s of CPU to build
        # Health checks and scrapes get a client of their own: they never queue behind proxied traffic.
        self.client = httpx.AsyncClient(timeout=timeout, verify=tls)
        self.upstream = ClientShards(UPSTREAM_CLIENT_SHARDS, timeout=timeout, verify=tls, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=30.0))
        self.registry = Registry(config, self.client, self.metrics)
        # Proxied completions go over the gateway's own HTTP/1.1 client: per relayed chunk it costs a
        # fraction of httpx's CPU (lockstep_gateway/upstream.py).
        self.relay_client = UpstreamClient(config.connect_timeout_s, UPSTREAM_WRITE_TIMEOUT_S, tls)
        self.proxy = Proxy(config, self.registry, self.relay_client, self.metrics, self.limiter, rng)
        self.registry.set_endpoints("static", config.engines)
        self._tasks: list[asyncio.Task] = []
        self._refusing: str | None = None  # the 503 last logged, until a request is served again
        self.large_bodies = LargeBodyReader()

    async def start(self) -> None:
        self.registry.start()
        if self.config.config_file:
            self._tasks.append(asyncio.create_task(
                watch_config_file(self.config.config_file, self.registry.set_endpoints)))
        namespaces: tuple[str | None, ...] = (None,) if self.config.kubernetes_all_namespaces \
            else self.config.kubernetes_namespaces
        if namespaces:
            api = KubeAPI.from_environment(self.config.kubeconfig)
            for namespace in namespaces:
                discovery = KubernetesDiscovery(api, namespace, self.config.kubernetes_label_selector,
                                                self.registry.set_endpoints,
                                                declare_models=self.registry.declare_models)
                self._tasks.append(asyncio.create_task(discovery.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.stop()
        await self.upstream.aclose()
        self.relay_client.close()
        await self.client.aclose()
        self.large_bodies.shutdown()

    # ---- one proxied request ------------------------------------------------------------------
    async def handle(self, request: Request, route: str) -> Response:
        request_id = _request_id(request)
        model_label = "unknown"
        status = 500
        proxy = self.proxy
        limit = self.config.max_in_flight
        if limit and proxy.in_flight >= limit:
            self.metrics.admission_refused.inc()
            self.metrics.requests.labels(route, model_label, "503").inc()
            return error_response(GatewayError(503, f"the gateway has {limit} requests in progress (--max-in-flight); "
                                                    "retry later", retry_after=self.config.retry_after_s), request_id)
        proxy.in_flight += 1  # no await since the check: admission is atomic on the event loop
        job = None
        handed_off = False
        try:
            job = await self._admit(request, route, request_id)
            if job.model in self.registry.known_models():
                model_label = job.model
            response = await proxy.forward(job)
            status = response.status_code
            if isinstance(response, Relayed):
                handed_off = True
                response.cleanups.append(self._release_stream)
            elif status >= 300 and self.limiter.enabled:
                self.limiter.refund(job.rate_key, job.estimated_tokens)
            response.headers["x-request-id"] = request_id
            if status < 500:
                self._refusing = None
            return response
        except GatewayError as error:
            status = error.status
            if job is not None and self.limiter.enabled:
                self.limiter.refund(job.rate_key, job.estimated_tokens)
            if status >= 500:
                self._log_failure(request_id, error)
            return error_response(error, request_id)
        finally:
            if not handed_off:
                proxy.in_flight -= 1
            self.metrics.requests.labels(route, model_label, str(status)).inc()

    def _log_failure(self, request_id: str, error: GatewayError) -> None:
        """A 503 (no engine ready yet, every engine saturated) is logged when it starts, not per request:
        while the engines load, every request gets one. Other failures are logged each time."""
        if error.status == 503:
            if error.message == self._refusing:
                return
            self._refusing = error.message
            log.warning("request %s: 503 %s (not logged again until a request is served)", request_id, error.message)
            return
        log.warning("request %s: %d %s", request_id, error.status, error.message)

    async def _release_stream(self) -> None:
        self.proxy.in_flight -= 1

    async def _admit(self, request: Request, route: str, request_id: str) -> Job:
        rate_key = self._authenticate(request)
        body = await self._read_body(request)
        if len(body) >= LARGE_BODY_BYTES:
            await self._refuse_by_size(body)
        payload = parse_json_object(body)
        model = self._model(payload)
        peer = request.client.host if request.client else None
        priority, sheddable = request_priority(request.headers, payload, self.priority_trust.trusts(rate_key, peer))
        estimate = estimate_tokens(payload, self.registry.max_model_len(model)) if route in GENERATION_ROUTES else 0
        if self.limiter.enabled:
            refused = self.limiter.admit(rate_key, estimate)
            if refused is not None:
                limit, retry_after = refused
                self.metrics.rate_limited.labels(limit).inc()
                raise GatewayError(429, f"rate limit exceeded: {limit} per minute for this key; retry in "
                                        f"{retry_after}s", retry_after=retry_after)
        headers = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": request_id}
        for name in FORWARDED_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        if self.registry.headers:
            headers.update(self.registry.headers)  # the engines' key, whatever the client sent
        elif not self.keys.enabled and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]  # the engine may check its own key
        # Only after the charge: a request refused before it (401, 400, 404, 429) has nothing to refund.
        hints = self.proxy.router.read(Incoming(model, payload, request.headers, route in GENERATION_ROUTES))
        return Job(request.url.path, route, body, model, headers, rate_key, estimate, request_id,
                   priority=priority, sheddable=sheddable, hints=hints,
                   disconnected=disconnect_watcher(request.receive))

    async def _refuse_by_size(self, body: bytes) -> None:
        """A 400 for a large body that its sizes decide, read in a worker process: parsed here first, a 16 MB
        body of token ids held the loop for a second. A prompt is held against the longest context of any
        model (the body's model is not known before the parse)."""
        lengths = [length for length in map(self.registry.max_model_len, self.registry.known_models()) if length]
        longest = max(lengths, default=None)
        limits = BodyLimits(longest, MAX_PROMPTS, max(longest or 0, MAX_LIST_ITEMS))
        refused = await asyncio.to_thread(self.large_bodies.refusal, body, limits)
        if refused is not None:
            raise GatewayError(400, *refused)

    def _authenticate(self, request: Request) -> str:
        """The rate-limit key: the API key's id, or the client address when keys are off."""
        if not self.keys.enabled:
            peer = request.client.host if request.client else None
            return "addr:" + self.client_address.of(peer, request.headers.get("x-forwarded-for"))
        key = self.keys.check(request.headers.get("authorization"))
        if key is None:
            raise GatewayError(401, UNAUTHORIZED)
        return key

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        too_large = GatewayError(413, f"the request body is larger than {limit} bytes")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                async for part in request.stream():
                    size += len(part)
                    if size > limit:
                        raise too_large
                    parts.append(part)
        except TimeoutError:
            raise GatewayError(408, f"the request body did not arrive within {self.config.body_timeout_s:g}s "
                                    "(--body-timeout)") from None
        return b"".join(parts)

    def _model(self, payload: dict) -> str:
        model = payload.get("model")
        known = self.registry.known_models()
        if model is None:
            served = self.registry.served_models(adapters=False)  # an adapter is never the default
            if len(served) == 1:
                return served[0]  # as vLLM: the one served model is the default
            firsts = {backend.models[0] for backend in self.registry.backends.values() if backend.models}
            if len(firsts) == 1 and self.registry.healthy(next(iter(firsts))):
                return firsts.pop()  # every engine's first served name (engines serving several names), as vLLM
            if not known:
                raise self._no_engine()
            raise GatewayError(400, "'model' is required: this gateway serves " + ", ".join(sorted(known)), "model")
        if not isinstance(model, str):
            raise GatewayError(400, "'model' must be a string", "model")
        if model not in known:
            if self.registry.any_unprobed():
                raise self._no_engine()
            available = self.registry.served_models() or sorted(known)
            raise GatewayError(404, f"The model `{model}` does not exist. Available: {', '.join(available)}.", "model")
        return model

    async def openapi(self) -> Response:
        """The engines' OpenAPI document (the request schemas of the routes proxied here), with the
        gateway's own routes: clients and schema fuzzers see what the gateway accepts."""
        for backend in self.registry.healthy():
            try:
                response = await self.client.get(backend.url + "/openapi.json", headers=self.registry.headers,
                                                 timeout=self.config.health_check_timeout_s)
                document = response.json()
            except (httpx.HTTPError, ValueError):
                continue
            if response.status_code != 200 or not isinstance(document.get("paths"), dict):
                continue
            document["paths"] = {path: spec for path, spec in document["paths"].items()
                                 if path in PROXIED_ROUTES or path in PASSTHROUGH_ROUTES or path in LOCAL_ROUTES}
            document["info"] = {"title": "Lockstep gateway", "version": __version__}
            return JSONResponse(document)
        return error_response(self._no_engine())

    async def passthrough(self, request: Request) -> Response:
        """A route that names no model, answered by any healthy engine as it answers it (5xx replaced)."""
        request_id = _request_id(request)
        status = 500
        try:
            if self.keys.enabled and self.keys.check(request.headers.get("authorization")) is None:
                raise GatewayError(401, UNAUTHORIZED)
            body = await self._read_body(request)
            headers = {"x-request-id": request_id, "accept-encoding": "identity", **self.registry.headers}
            if request.headers.get("content-type"):
                headers["content-type"] = request.headers["content-type"]
            if not self.registry.headers and not self.keys.enabled and "authorization" in request.headers:
                headers["authorization"] = request.headers["authorization"]
            for backend in self.registry.healthy():
                try:
                    answer = await self.upstream.pick().request(
                        request.method, backend.url + _wire_path(request), params=request.query_params, content=body,
                        headers=headers, timeout=self.config.first_byte_timeout_s)
                except httpx.HTTPError as error:
                    log.info("engine %s did not answer %s %s: %s", backend.url, request.method, request.url.path,
                             type(error).__name__)
                    continue
                if answer.status_code >= 500:
                    log.warning("request %s: engine %s answered %s %s with %d", request_id, backend.url,
                                request.method, request.url.path, answer.status_code)
                    raise GatewayError(502, "the engine failed to answer this request")
                status = answer.status_code
                return Response(answer.content, status_code=status, headers={"x-request-id": request_id},
                                media_type=answer.headers.get("content-type", "application/json"))
            raise self._no_engine()
        except GatewayError as error:
            status = error.status
            return error_response(error, request_id)
        finally:
            self.metrics.requests.labels("responses_stored", "unknown", str(status)).inc()

    def _no_engine(self) -> GatewayError:
        return GatewayError(503, "no engine is available yet; retry later", retry_after=self.config.retry_after_s)

    # ---- local routes ---------------------------------------------------------------------------
    def models(self) -> dict:
        """What the engines report of each model they serve (`max_model_len`, `root`, ...)."""
        data = [self.model(name) for name in self.registry.served_models()]
        return {"object": "list", "data": [card for card in data if card is not None]}

    def model(self, name: str) -> dict | None:
        card = self.registry.model_card(name)
        if card is not None:
            card["created"] = int(time.time())
        return card

    def engines(self) -> dict:
        now = time.monotonic()
        return {"engines": [
            {"url": b.url, "id": engine_id(b.url), "healthy": b.healthy, "suspect": b.suspect, "breaker_open": b.breaker.is_open,
             "models": list(b.models), "adapters": list(b.adapters), "in_flight": b.in_flight,
             "load": None if b.load is None else vars(b.load), "load_age_s": round(now - b.load_time, 3)
             if b.load is not None else None}
            for b in self.registry.backends.values()]}


def _wire_path(request: Request) -> str:
    """The path as the client sent it, percent-escapes kept and any other byte outside a URL's set escaped.

    Relaying the decoded path would turn an escaped `/` into a separator and hand httpx control characters
    it refuses, so an odd stored-response id became a 500 instead of the engine's 404.
    """
    raw = request.scope.get("raw_path") or request.url.path.encode()
    return urllib.parse.quote(raw.decode("latin-1"), safe="/%:@!$&'()*+,;=-._~", encoding="latin-1")


def build_app(config: GatewayConfig, gateway: Gateway | None = None) -> FastAPI:
    gateway = gateway or Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        freeze_startup_heap()  # the app and the imports stay: full collections walk what serving allocates
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="Lockstep gateway", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message, headers = str(error.detail), getattr(error, "headers", None)
        if error.status_code == 404:
            message = route_not_found(request.method, request.url.path)
        elif error.status_code == 405 and headers and "Allow" in headers:
            message = f"{request.method} is not allowed on {request.url.path}: allowed {headers['Allow']}"
        return JSONResponse(error_body(error.status_code, message), status_code=error.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        request_id = _request_id(request)
        log.exception("request %s: unexpected error on %s", request_id, request.url.path)
        return error_response(GatewayError(500, "internal gateway error"), request_id)

    def proxied(route: str):
        async def endpoint(request: Request) -> Response:
            return await gateway.handle(request, route)

        return endpoint

    for path, route in PROXIED_ROUTES.items():
        # A plain Starlette route: FastAPI's dependency solving would only add per-request cost here.
        app.router.routes.append(Route(path, proxied(route), methods=["POST"]))

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        if gateway.keys.enabled and gateway.keys.check(request.headers.get("authorization")) is None:
            return error_response(GatewayError(401, UNAUTHORIZED))
        return JSONResponse(gateway.models())

    for path, methods in PASSTHROUGH_ROUTES.items():
        app.router.routes.append(Route(path, gateway.passthrough, methods=list(methods)))

    async def adapters_not_here(request: Request) -> Response:
        path = request.url.path
        return error_response(GatewayError(404, f"{request.method} {path}: the gateway does not load LoRA adapters: "
                                                f"they are loaded on the engines ({path} of each engine; in Kubernetes "
                                                "the operator does it), and the gateway reads them from each engine's "
                                                "/v1/models"))

    for path in ADAPTER_ROUTES:
        app.router.routes.append(Route(path, adapters_not_here, methods=["POST"]))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        if gateway.keys.enabled and gateway.keys.check(request.headers.get("authorization")) is None:
            return error_response(GatewayError(401, UNAUTHORIZED))
        card = gateway.model(model_id)
        if card is None and model_id in gateway.registry.known_models():
            return error_response(gateway._no_engine())
        if card is None:
            return error_response(GatewayError(404, f"The model `{model_id}` does not exist.", "model"))
        return JSONResponse(card)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return await gateway.openapi()

    @app.get("/health")
    @app.get("/ping")  # vLLM's SageMaker-style liveness route: the same answer
    @app.post("/ping")
    async def health() -> JSONResponse:
        return health_response(gateway.registry)

    @app.get("/ready")  # the readiness probe (/health, the liveness probe, answers 200 with no engine)
    async def ready() -> JSONResponse:
        return ready_response(gateway.registry)

    @app.get("/gateway/engines")
    async def engines(request: Request) -> Response:
        if gateway.keys.enabled and gateway.keys.check(request.headers.get("authorization")) is None:
            return error_response(GatewayError(401, UNAUTHORIZED))
        return JSONResponse(gateway.engines())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    if config.cors_allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(QueryKeyGuard)
    app.add_middleware(AnthropicRoutes)  # outermost: x-api-key and Anthropic-shaped errors on /v1/messages
    return app


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    if given and _CLIENT_REQUEST_ID.fullmatch(given):
        return given
    return "gw-" + uuid.uuid4().hex[:20]
