"""Forwarding one client request: choose an engine, retry before the first byte, relay SSE chunk by chunk.

Nothing reaches the client before the engine's first body byte has reached the gateway, so every
failure up to that point (refused connection, 502/503/504, connect or first-byte timeout, a reset
before the first chunk) is retried on another engine. After it, a failure ends the stream with an
SSE error event. Between chunks the idle timeout applies; a client that goes away closes the
upstream connection, which makes the engine abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass

import httpx
from starlette.responses import Response, StreamingResponse

from lockstep_gateway.backends import Backend, Registry
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.errors import GatewayError, sse_error_event
from lockstep_gateway.metrics import GatewayMetrics
from lockstep_gateway.ratelimit import RateLimiter
from lockstep_gateway.routing import HashRing, is_saturated, pick_least_load, pick_round_robin

log = logging.getLogger("lockstep.gateway")
RETRYABLE_STATUSES = (502, 503, 504)


@dataclass
class Job:
    """One client request as the proxy sees it."""

    path: str
    route: str
    body: bytes
    model: str
    headers: dict[str, str]  # to send upstream
    session: str | None
    rate_key: str
    estimated_tokens: int


class _Retry(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Proxy:
    def __init__(self, config: GatewayConfig, registry: Registry, clients: ClientShards, metrics: GatewayMetrics,
                 limiter: RateLimiter, rng: random.Random | None = None):
        self.config = config
        self.registry = registry
        self.clients = clients
        self.metrics = metrics
        self.limiter = limiter
        self.rng = rng or random.Random()
        self._round_robin = 0
        self._rings: dict[tuple[str, ...], HashRing] = {}

    # ---- choosing ---------------------------------------------------------------------------------
    def choose(self, job: Job, tried: set[str]) -> Backend | None:
        now = time.monotonic()
        pool = self.registry.healthy(job.model)
        by_url = {b.url: b for b in pool}
        cfg = self.config

        def usable(backend: Backend) -> bool:
            return backend.url not in tried and not is_saturated(
                backend.candidate(now), cfg.metrics_stale_s, cfg.saturation_queue_depth, cfg.max_in_flight_per_engine)

        if cfg.session_affinity and job.session is not None:
            for url in self._ring(tuple(sorted(by_url))).preference(job.session):
                if usable(by_url[url]):
                    return by_url[url]
            return None
        backends = [b for b in pool if usable(b)]
        if not backends:
            return None
        candidates = [b.candidate(now) for b in backends]
        if cfg.routing == "round-robin":
            self._round_robin += 1
            chosen = pick_round_robin(candidates, self._round_robin)
        else:
            chosen = pick_least_load(candidates, cfg.metrics_stale_s, self.rng)
        return by_url[chosen.url]

    def _ring(self, members: tuple[str, ...]) -> HashRing:
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) > 64:
                self._rings.clear()
            ring = self._rings[members] = HashRing(members)
        return ring

    # ---- forwarding -------------------------------------------------------------------------------
    async def forward(self, job: Job) -> Response:
        tried: set[str] = set()
        reason = None
        for attempt in range(1 + self.config.max_retries):
            backend = self.choose(job, tried)
            if backend is None:
                break
            tried.add(backend.url)
            if attempt:
                self.metrics.retries.labels(reason.split(":")[0]).inc()
            try:
                return await self._attempt(backend, job)
            except _Retry as retry:
                reason = retry.reason
                log.info("engine %s failed before the first byte (%s)", backend.url, reason)
        if reason is None:
            if self.registry.healthy(job.model):
                message = f"every engine serving {job.model!r} is saturated; retry later"
            else:
                message = f"no engine serving {job.model!r} is available; retry later"
        else:
            message = f"engines serving {job.model!r} failed ({reason}); retry later"
        raise GatewayError(503, message, retry_after=self.config.retry_after_s)

    async def _attempt(self, backend: Backend, job: Job) -> Response:
        cfg = self.config
        metrics = self.metrics
        engine = backend.url
        self._track(backend, +1)
        handed_off = False
        response = None
        started = time.monotonic()
        try:
            client = self.clients.pick()
            request = client.build_request("POST", engine + job.path, content=job.body, headers=job.headers)
            try:
                response = await asyncio.wait_for(client.send(request, stream=True), cfg.first_byte_timeout_s)
            except httpx.ConnectError as error:
                self.registry.eject(backend, f"connect failed: {error}")
                raise self._fail(engine, "error", "connect") from None
            except httpx.ConnectTimeout:
                raise self._fail(engine, "timeout", "connect_timeout") from None
            except (asyncio.TimeoutError, httpx.TimeoutException):
                raise self._fail(engine, "timeout", "first_byte_timeout") from None
            except httpx.HTTPError as error:
                raise self._fail(engine, "error", f"upstream: {type(error).__name__}") from None
            if response.status_code in RETRYABLE_STATUSES:
                raise self._fail(engine, "retried", f"status {response.status_code}")
            chunks = response.aiter_raw()
            remaining = max(cfg.first_byte_timeout_s - (time.monotonic() - started), 0.001)
            first = await self._next(chunks, remaining, engine)
            metrics.upstream_latency.labels(job.route, "first_byte").observe(time.monotonic() - started)
            content_type = response.headers.get("content-type", "application/json")
            if content_type.startswith("text/event-stream"):
                handed_off = True
                return StreamingResponse(self._relay(backend, job, response, chunks, first, started),
                                         status_code=response.status_code, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            parts = [first or b""]
            if first is not None:
                # A plain JSON answer is read whole: a failure before its end can still be retried.
                while (part := await self._next(chunks, cfg.idle_timeout_s, engine)) is not None:
                    parts.append(part)
            body = b"".join(parts)
            metrics.upstream_latency.labels(job.route, "total").observe(time.monotonic() - started)
            metrics.upstream_requests.labels(engine, "ok").inc()
            if response.status_code == 200:
                self._settle_from_json(job, body)
            return Response(body, status_code=response.status_code, media_type=content_type)
        finally:
            if not handed_off:
                if response is not None:
                    await _close(response)
                self._track(backend, -1)

    def _track(self, backend: Backend, delta: int) -> None:
        backend.in_flight += delta
        if self.registry.backends.get(backend.url) is backend:  # a forgotten engine has no series any more
            self.metrics.upstream_in_flight.labels(backend.url).inc(delta)

    def _fail(self, engine: str, outcome: str, reason: str) -> _Retry:
        self.metrics.upstream_requests.labels(engine, outcome).inc()
        return _Retry(reason)

    async def _next(self, chunks, timeout: float, engine: str) -> bytes | None:
        """The next raw chunk within `timeout`, before anything reached the client (so a failure is
        retryable); None at the end of the body."""
        try:
            return await asyncio.wait_for(chunks.__anext__(), timeout)
        except StopAsyncIteration:
            return None
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise self._fail(engine, "timeout", "first_byte_timeout") from None
        except httpx.HTTPError as error:
            raise self._fail(engine, "error", f"upstream: {type(error).__name__}") from None

    async def _relay(self, backend: Backend, job: Job, response: httpx.Response, chunks, first: bytes | None,
                     started: float):
        """Pass SSE through as it comes, whole events only, so an error event never lands inside a
        half-written one."""
        metrics = self.metrics
        engine = backend.url
        pending = b""
        chunk = first
        outcome = "ok"
        idle = self.config.idle_timeout_s
        loop = asyncio.get_running_loop()
        try:
            async with _idle_timer(idle) as timer:
                while chunk is not None:
                    if not pending and chunk.endswith(b"\n\n"):
                        complete = chunk
                    else:
                        pending += chunk
                        cut = pending.rfind(b"\n\n") + 2
                        complete, pending = pending[:cut], pending[cut:]
                    if complete:
                        if b'"usage":{' in complete or b'"usage": {' in complete:
                            self._settle_from_sse(job, complete)
                        _reschedule(timer, None)  # a slow client is not an idle engine
                        yield complete
                    _reschedule(timer, loop.time() + idle)
                    chunk = await _next_chunk(chunks, None if timer else idle)
            if pending:
                yield pending
        except (asyncio.TimeoutError, httpx.TimeoutException):
            outcome = "timeout"
            metrics.stream_errors.labels("idle_timeout").inc()
            yield sse_error_event(504, f"the engine sent nothing for {self.config.idle_timeout_s:g}s; stream ended")
        except httpx.HTTPError as error:
            outcome = "error"
            metrics.stream_errors.labels("upstream_lost").inc()
            log.warning("stream from %s broke: %s", engine, type(error).__name__)
            yield sse_error_event(502, "the connection to the engine was lost mid-stream")
        finally:
            metrics.upstream_requests.labels(engine, outcome).inc()
            metrics.upstream_latency.labels(job.route, "total").observe(time.monotonic() - started)
            self._track(backend, -1)
            await _close(response)

    # ---- token accounting ---------------------------------------------------------------------------
    def _settle(self, job: Job, usage) -> None:
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            self.limiter.settle(job.rate_key, job.estimated_tokens, usage["total_tokens"])

    def _settle_from_json(self, job: Job, body: bytes) -> None:
        if self.limiter.tpm:
            try:
                self._settle(job, json.loads(body).get("usage"))
            except (ValueError, AttributeError):
                pass

    def _settle_from_sse(self, job: Job, events: bytes) -> None:
        if not self.limiter.tpm:
            return
        for line in events.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    self._settle(job, json.loads(line[6:]).get("usage"))
                except (ValueError, AttributeError):
                    pass


# One timer per stream, moved on at every chunk (asyncio.timeout, Python 3.11+), instead of a
# wait_for per chunk, which costs a task each time: at 1,000 streams that is most of the CPU.
if hasattr(asyncio, "timeout"):
    def _idle_timer(seconds: float):
        return asyncio.timeout(seconds)
else:  # Python 3.10: wait_for per chunk
    def _idle_timer(seconds: float):
        return contextlib.nullcontext()


def _reschedule(timer, when: float | None) -> None:
    if timer is not None:
        timer.reschedule(when)


async def _next_chunk(chunks, timeout: float | None) -> bytes | None:
    try:
        if timeout is None:
            return await chunks.__anext__()
        return await asyncio.wait_for(chunks.__anext__(), timeout)
    except StopAsyncIteration:
        return None


class ClientShards:
    """Several httpx clients used in turn: httpcore's pool scans all its connections for every
    request, which turns quadratic at a thousand open streams; shards keep each pool small."""

    def __init__(self, num_shards: int, **client_kwargs):
        self.clients = [httpx.AsyncClient(**client_kwargs) for _ in range(num_shards)]
        self._next = 0

    def pick(self) -> httpx.AsyncClient:
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


async def _close(response: httpx.Response) -> None:
    try:
        await response.aclose()
    except Exception:  # noqa: BLE001 - the connection is being dropped anyway
        pass
