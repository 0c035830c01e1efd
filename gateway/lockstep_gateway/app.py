"""The gateway's FastAPI app: OpenAI routes in front of the engines, plus /health and /metrics.

Per request, in this order: API key (401), body size (413), JSON (400), model -> pool (404 for a
model no engine ever served), per-key rate limits (429 + Retry-After), then the proxy (503 +
Retry-After when no engine can take it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import time

import httpx
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import lockstep
from lockstep_gateway.auth import KeyChecker, load_keys
from lockstep_gateway.backends import Registry
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.discovery import KubeAPI, KubernetesDiscovery, watch_config_file
from lockstep_gateway.errors import GatewayError, error_body, error_response
from lockstep_gateway.metrics import CONTENT_TYPE, GatewayMetrics
from lockstep_gateway.proxy import ClientShards, Job, Proxy
from lockstep_gateway.ratelimit import RateLimiter, estimate_tokens
from lockstep_gateway.routing import session_key

log = logging.getLogger("lockstep.gateway")

# path -> route label
PROXIED_ROUTES = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
GENERATION_ROUTES = ("completions", "chat_completions")
UPSTREAM_CLIENT_SHARDS = 16
# Headers the engine may need; everything else (hop-by-hop, host, cookies) stays here.
FORWARDED_HEADERS = ("x-request-id", "traceparent", "tracestate")


class Gateway:
    """What the routes share."""

    def __init__(self, config: GatewayConfig, rng: random.Random | None = None):
        self.config = config
        self.metrics = GatewayMetrics()
        self.keys = KeyChecker(load_keys(config.api_key_files, config.api_keys))
        self.limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
        timeout = httpx.Timeout(connect=config.connect_timeout_s, read=None, write=30.0, pool=None)
        tls = ssl.create_default_context()  # one for every client: each costs ~0.15 s of CPU to build
        # Health checks and scrapes get a client of their own: they never queue behind proxied traffic.
        self.client = httpx.AsyncClient(timeout=timeout, verify=tls)
        self.upstream = ClientShards(UPSTREAM_CLIENT_SHARDS, timeout=timeout, verify=tls, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=30.0))
        self.registry = Registry(config, self.client, self.metrics)
        self.proxy = Proxy(config, self.registry, self.upstream, self.metrics, self.limiter, rng)
        self.registry.set_endpoints("static", config.engines)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.registry.start()
        if self.config.config_file:
            self._tasks.append(asyncio.create_task(
                watch_config_file(self.config.config_file, self.registry.set_endpoints)))
        if self.config.kubernetes_namespaces:
            api = KubeAPI.from_environment(self.config.kubeconfig)
            for namespace in self.config.kubernetes_namespaces:
                discovery = KubernetesDiscovery(api, namespace, self.config.kubernetes_label_selector,
                                                self.registry.set_endpoints)
                self._tasks.append(asyncio.create_task(discovery.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.stop()
        await self.upstream.aclose()
        await self.client.aclose()

    # ---- one proxied request ------------------------------------------------------------------
    async def handle(self, request: Request, route: str) -> Response:
        model_label = "unknown"
        status = 500
        try:
            job = await self._admit(request, route)
            if job.model in self.registry.known_models():
                model_label = job.model
            response = await self.proxy.forward(job)
            status = response.status_code
            return response
        except GatewayError as error:
            status = error.status
            return error_response(error)
        finally:
            self.metrics.requests.labels(route, model_label, str(status)).inc()

    async def _admit(self, request: Request, route: str) -> Job:
        rate_key = self._authenticate(request)
        body = await self._read_body(request)
        try:
            payload = json.loads(body)
        except ValueError as error:
            raise GatewayError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(payload, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        model = self._model(payload)
        estimate = estimate_tokens(payload) if route in GENERATION_ROUTES else 0
        if self.limiter.enabled:
            refused = self.limiter.admit(rate_key, estimate)
            if refused is not None:
                limit, retry_after = refused
                self.metrics.rate_limited.labels(limit).inc()
                raise GatewayError(429, f"rate limit exceeded: {limit} per minute for this key; retry in "
                                        f"{retry_after}s", retry_after=retry_after)
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        for name in FORWARDED_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        if not self.keys.enabled and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]  # the engine may check its own key
        session = session_key(request.headers, payload, self.config.session_header)
        return Job(request.url.path, route, body, model, headers, session, rate_key, estimate)

    def _authenticate(self, request: Request) -> str:
        """The rate-limit key: the API key's id, or the client address when keys are off."""
        if not self.keys.enabled:
            return "addr:" + (request.client.host if request.client else "unknown")
        key = self.keys.check(request.headers.get("authorization"))
        if key is None:
            raise GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
        return key

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        too_large = GatewayError(413, f"the request body is larger than {limit} bytes")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
        return b"".join(parts)

    def _model(self, payload: dict) -> str:
        model = payload.get("model")
        known = self.registry.known_models()
        if model is None:
            served = self.registry.served_models()
            if len(served) == 1:
                return served[0]  # as vLLM: the one served model is the default
            if not known:
                raise self._no_engine()
            raise GatewayError(400, "'model' is required: this gateway serves " + ", ".join(sorted(known)), "model")
        if not isinstance(model, str):
            raise GatewayError(400, "'model' must be a string", "model")
        if model not in known:
            if self.registry.any_unprobed():
                raise self._no_engine()
            raise GatewayError(404, f"the model {model!r} does not exist", "model")
        return model

    def _no_engine(self) -> GatewayError:
        return GatewayError(503, "no engine is available yet; retry later", retry_after=self.config.retry_after_s)

    # ---- local routes ---------------------------------------------------------------------------
    def models(self) -> dict:
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "lockstep", "root": name}
                for name in self.registry.served_models()]
        return {"object": "list", "data": data}

    def engines(self) -> dict:
        now = time.monotonic()
        return {"engines": [
            {"url": b.url, "healthy": b.healthy, "models": list(b.models), "in_flight": b.in_flight,
             "load": None if b.load is None else vars(b.load), "load_age_s": round(now - b.load_time, 3)
             if b.load is not None else None}
            for b in self.registry.backends.values()]}


def build_app(config: GatewayConfig, gateway: Gateway | None = None) -> FastAPI:
    gateway = gateway or Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="Lockstep gateway", version=lockstep.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = "not found" if error.status_code == 404 else str(error.detail)
        return JSONResponse(error_body(error.status_code, message), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal gateway error"), status_code=500)

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
            return error_response(GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')"))
        return JSONResponse(gateway.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = gateway.registry.healthy()
        return JSONResponse({"status": "ok", "engines": len(gateway.registry.backends),
                             "healthy_engines": len(healthy), "models": gateway.registry.served_models()})

    @app.get("/gateway/engines")
    async def engines(request: Request) -> Response:
        if gateway.keys.enabled and gateway.keys.check(request.headers.get("authorization")) is None:
            return error_response(GatewayError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')"))
        return JSONResponse(gateway.engines())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": lockstep.__version__})

    if config.cors_allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    return app
