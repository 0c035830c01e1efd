"""Forwarding one client request: choose an engine, retry only what no engine accepted, relay SSE.

A request is replayed on another engine only when the first one certainly did not start it: the
connection was refused or never established, the request could not be written, or the engine
answered 503 with the `X-Lockstep-Retryable` header (it refused the request before accepting it:
overloaded, loading, draining). Anything else that goes wrong after the request reached an engine
(a reset, the engine dying, a first-byte timeout, an ejection for unresponsiveness, a 5xx) ends
with an OpenAI-shaped 502/503/504 to this client only: replaying it could take the next engine down
too (a poison request). Retries are bounded per request (`max_retries`) and overall (a retry
budget); failed attempts feed each engine's circuit breaker.

Nothing reaches the client before the engine's first body byte has reached the gateway. After it,
a failure ends the stream with an SSE error event. Between chunks the idle timeout applies; a
client that goes away closes the upstream connection, which makes the engine abort the request and
free its KV blocks. An engine's own 5xx bodies are logged and replaced: they may carry internals.
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
from lockstep_gateway.breaker import RetryBudget
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.errors import GatewayError, sse_error_event
from lockstep_gateway.metrics import GatewayMetrics
from lockstep_gateway.ratelimit import RateLimiter
from lockstep_gateway.routing import (
    HashRing,
    is_saturated,
    pick_least_load,
    pick_round_robin,
)

log = logging.getLogger("lockstep.gateway")
# An engine that refuses a request before accepting it says so with this header on its 503.
RETRYABLE_HEADER = "x-lockstep-retryable"
ENGINE_MESSAGE_LOG_CHARS = 2000


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
    request_id: str = ""
    settled: bool = False  # the engine reported usage and the rate limiter was corrected


# Retry reasons of attempts whose request no engine received: the connection failed before it was written.
UNSEEN_REASONS = frozenset(("connect", "connect_timeout", "write"))


class _Retry(Exception):
    """The engine did not accept the request: another engine may take it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Relayed(StreamingResponse):
    """A streamed answer that releases what it holds (the engine's slot, the upstream response,
    the gateway's admission) exactly once, even when the client leaves before the first chunk
    and the body iterator never starts."""

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self.cleanups = [cleanup]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for cleanup in self.cleanups:
                await cleanup()
            self.cleanups = []


class Proxy:
    def __init__(self, config: GatewayConfig, registry: Registry, clients: ClientShards, metrics: GatewayMetrics,
                 limiter: RateLimiter, rng: random.Random | None = None):
        self.config = config
        self.registry = registry
        self.clients = clients
        self.metrics = metrics
        self.limiter = limiter
        self.rng = rng or random.Random()
        self.in_flight = 0  # client requests admitted and not answered yet (streams until their end)
        self.budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min)
        self._round_robin = 0
        self._rings: dict[tuple[str, ...], HashRing] = {}

    # ---- choosing ---------------------------------------------------------------------------------
    def choose(self, job: Job, tried: set[str]) -> Backend | None:
        now = time.monotonic()
        pool = [b for b in self.registry.healthy(job.model) if b.breaker.allows(now)]
        if any(not b.suspect for b in pool):
            pool = [b for b in pool if not b.suspect]  # a suspect engine only when nothing else is left
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
        budgeted = False  # whether the retry in progress counts against the budget
        for attempt in range(1 + self.config.max_retries):
            # A retry after a connection that failed before the request was written costs the engines
            # nothing the first attempt had not: no engine saw the request. Only retries after an
            # engine answered (overloaded, draining) are bounded by the budget.
            budgeted = attempt > 0 and reason not in UNSEEN_REASONS
            if budgeted and not self.budget.allows(self.in_flight):
                self.metrics.retries_refused.inc()
                reason = f"{reason}; the retry budget is spent"
                break
            backend = self.choose(job, tried)
            if backend is None:
                break
            tried.add(backend.url)
            if attempt:
                self.metrics.retries.labels(reason.split(":")[0]).inc()
            if budgeted:
                self.budget.retrying += 1
            try:
                return await self._attempt(backend, job)
            except _Retry as retry:
                reason = retry.reason
                log.info("engine %s did not take the request (%s)", backend.url, reason)
            finally:
                if budgeted:
                    self.budget.retrying -= 1
        if reason is None:
            if self.registry.healthy(job.model):
                message = f"every engine serving {job.model!r} is saturated; retry later"
            else:
                message = f"no engine serving {job.model!r} is available; retry later"
        else:
            message = f"engines serving {job.model!r} did not take the request ({reason}); retry later"
        raise GatewayError(503, message, retry_after=self.config.retry_after_s)

    async def _attempt(self, backend: Backend, job: Job) -> Response:
        metrics = self.metrics
        engine = backend.url
        backend.breaker.on_attempt(time.monotonic())
        self._track(backend, +1)
        released = handed_off = False
        response = None
        started = time.monotonic()

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                if response is not None:
                    await _close(response)
                self._track(backend, -1)

        try:
            response, chunks, first = await self._first_byte(backend, job)
            metrics.upstream_latency.labels(job.route, "first_byte").observe(time.monotonic() - started)
            content_type = response.headers.get("content-type", "application/json")
            if response.status_code >= 500:
                body = b"" if first is None else first + await self._rest(chunks, engine)
                raise self._engine_failed(backend, job, response.status_code, body)
            if content_type.startswith("text/event-stream"):
                handed_off = True  # released when the stream ends
                return Relayed(self._relay(backend, job, response, chunks, first, started), release,
                               status_code=response.status_code, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            body = b"" if first is None else first + await self._rest(chunks, engine)
            metrics.upstream_latency.labels(job.route, "total").observe(time.monotonic() - started)
            metrics.upstream_requests.labels(engine, "ok").inc()
            backend.breaker.on_success()
            if response.status_code == 200:
                self._settle_from_json(job, body)
            return Response(body, status_code=response.status_code, media_type=content_type)
        except GatewayError:
            self._breaker_failure(backend)
            raise
        finally:
            if not handed_off:
                await release()

    async def _first_byte(self, backend: Backend, job: Job):
        """Send the request; (response, body iterator, first chunk or None). Raises `_Retry` when
        the engine did not accept it, GatewayError when it did and then failed, timed out or was
        ejected as unresponsive."""
        cfg = self.config
        engine = backend.url
        client = self.clients.pick()
        request = client.build_request("POST", engine + job.path, content=job.body, headers=job.headers)
        sending = asyncio.ensure_future(self._send(client, request))
        ejected = backend.unresponsive_signal()
        try:
            done, _ = await asyncio.wait((sending, ejected), timeout=cfg.first_byte_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(BaseException):
                    await sending
        if sending in done:
            try:
                return sending.result()
            except _Retry:
                self.metrics.upstream_requests.labels(engine, "retried").inc()
                raise
            except httpx.ConnectError as error:
                self.registry.eject(backend, f"connect failed: {error}")
                raise self._fail(engine, "error", "connect") from None
            except httpx.ConnectTimeout:
                raise self._fail(engine, "timeout", "connect_timeout") from None
            except httpx.WriteError:  # the engine never read the whole request, so it cannot have started it
                raise self._fail(engine, "error", "write") from None
            except (httpx.TimeoutException, asyncio.TimeoutError):
                self.metrics.upstream_requests.labels(engine, "timeout").inc()
                raise GatewayError(504, f"the engine did not answer within {cfg.first_byte_timeout_s:g}s "
                                        "(not retried: it may have started the request)") from None
            except httpx.HTTPError as error:
                self.metrics.upstream_requests.labels(engine, "error").inc()
                log.warning("engine %s lost request %s after accepting it: %s", engine, job.request_id,
                            type(error).__name__)
                raise GatewayError(502, "the engine closed the connection before answering (not retried: "
                                        "it may have started the request)", retry_after=cfg.retry_after_s) from None
        self.metrics.upstream_requests.labels(engine, "timeout").inc()
        if ejected in done:
            raise GatewayError(503, "the engine stopped answering and was taken out of rotation (not retried: it "
                                    "may have started the request)", retry_after=cfg.retry_after_s)
        raise GatewayError(504, f"the engine did not answer within {cfg.first_byte_timeout_s:g}s "
                                "(not retried: it may have started the request)")

    async def _send(self, client: httpx.AsyncClient, request: httpx.Request):
        response = await client.send(request, stream=True)
        try:
            if response.status_code == 503 and RETRYABLE_HEADER in response.headers:
                raise _Retry("status 503")
            chunks = response.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = None
            return response, chunks, first
        except BaseException:
            await _close(response)
            raise

    async def _rest(self, chunks, engine: str) -> bytes:
        """The rest of a plain (not streamed) answer, chunk by chunk within the idle timeout."""
        parts = []
        while True:
            try:
                part = await asyncio.wait_for(chunks.__anext__(), self.config.idle_timeout_s)
            except StopAsyncIteration:
                return b"".join(parts)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                self.metrics.upstream_requests.labels(engine, "timeout").inc()
                raise GatewayError(504, f"the engine's answer stalled for {self.config.idle_timeout_s:g}s") from None
            except httpx.HTTPError:
                self.metrics.upstream_requests.labels(engine, "error").inc()
                raise GatewayError(502, "the connection to the engine was lost mid-answer (not retried)") from None
            parts.append(part)

    def _engine_failed(self, backend: Backend, job: Job, status: int, body: bytes) -> GatewayError:
        self.metrics.upstream_requests.labels(backend.url, "error").inc()
        log.warning("engine %s answered %d to request %s: %s", backend.url, status, job.request_id,
                    body[:ENGINE_MESSAGE_LOG_CHARS].decode(errors="replace"))
        if status == 503:
            return GatewayError(503, "the engine could not serve this request (not retried: it may have started "
                                     "it)", retry_after=self.config.retry_after_s)
        return GatewayError(502, f"the engine failed with status {status} while serving this request "
                                 "(not retried: it may have started it)")

    def _breaker_failure(self, backend: Backend) -> None:
        if backend.breaker.on_failure(time.monotonic()):
            self.metrics.breaker_opened.labels(backend.url).inc()
            log.warning("engine %s: circuit breaker open for %gs after %d failed requests", backend.url,
                        self.config.breaker_cooldown_s, backend.breaker.failures)

    def _track(self, backend: Backend, delta: int) -> None:
        backend.in_flight += delta
        if self.registry.backends.get(backend.url) is backend:  # a forgotten engine has no series any more
            self.metrics.upstream_in_flight.labels(backend.url).inc(delta)

    def _fail(self, engine: str, outcome: str, reason: str) -> _Retry:
        self.metrics.upstream_requests.labels(engine, outcome).inc()
        return _Retry(reason)

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
            if outcome == "ok":
                backend.breaker.on_success()
            else:
                self._breaker_failure(backend)

    # ---- token accounting ---------------------------------------------------------------------------
    def _settle(self, job: Job, usage) -> None:
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int) and not job.settled:
            job.settled = True
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
    with contextlib.suppress(Exception):  # the connection is being dropped anyway
        await response.aclose()
