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
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from lockstep_gateway.backends import Backend, Registry
from lockstep_gateway.breaker import RetryBudget
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.errors import GatewayError, sse_error_event
from lockstep_gateway.flow_control import QUEUED_REQUEST_OVERHEAD_BYTES, FlowControl, QueueRefused
from lockstep_gateway.metrics import GatewayMetrics
from lockstep_gateway.ratelimit import RateLimiter
from lockstep_gateway.routing import (
    HashRing,
    PrefixIndex,
    is_saturated,
    pick_least_load,
    pick_prefix_aware,
    pick_round_robin,
)
from lockstep_gateway.upstream import (
    ConnectFailed,
    ConnectTimeout,
    IdleTimeout,
    UpstreamClient,
    UpstreamError,
    WriteFailed,
)
from lockstep_gateway.upstream import Response as UpstreamResponse

log = logging.getLogger("lockstep.gateway")
# An engine that refuses a request before accepting it says so with this header on its 503.
RETRYABLE_HEADER = "x-lockstep-retryable"
# An engine that failed one request and stays healthy marks its 500 with this header: not the engine's fault.
REQUEST_FAULT_HEADER = "x-lockstep-request-fault"
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
    priority: int = 0  # lower is served earlier (vLLM's `priority`; flow_control.request_priority)
    sheddable: bool = False  # refused at once rather than queued when no engine has room
    prefix: tuple[int, ...] = ()  # the prompt's leading block hashes, for prefix-aware routing
    disconnected: Callable[[], Awaitable[None]] | None = None  # returns when the client has gone


# Retry reasons of attempts whose request no engine received: the connection failed before it was written.
UNSEEN_REASONS = frozenset(("connect", "connect_timeout", "write"))


class RequestFault(GatewayError):
    """The engine answered 500 and says the request caused it: the breaker does not count it."""


class _Retry(Exception):
    """The engine did not accept the request: another engine may take it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Relayed:
    """A streamed answer, sent as ASGI messages straight from the upstream connection (no
    StreamingResponse: no task group, no iterator layers per chunk). It releases what it holds (the
    engine's slot, the upstream connection, the gateway's admission) exactly once, even when the
    client leaves before the first chunk. A client that goes away closes the upstream connection, so
    the engine aborts the request and frees its KV blocks."""

    def __init__(self, status_code: int, cleanup, relay, on_gone):
        self.status_code = status_code
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        self.cleanups = [cleanup]
        self.relay = relay  # async (send, relayed) -> None
        self._on_gone = on_gone
        self.gone = False  # the client disconnected
        self.finished = False  # the last message is being sent

    async def __call__(self, scope, receive, send) -> None:
        watcher = None
        try:
            headers = [(b"content-type", b"text/event-stream"),
                       *((name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items())]
            await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
            watcher = asyncio.ensure_future(self._watch(receive))  # one task per stream, none per chunk
            await self.relay(send, self)
        finally:
            if watcher is not None:
                watcher.cancel()
            for cleanup in self.cleanups:
                await cleanup()
            self.cleanups = []

    async def _watch(self, receive) -> None:
        # The body was read before: the next message is the client's disconnect (or the response's end).
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.gone = True
            self._on_gone()


class Proxy:
    def __init__(self, config: GatewayConfig, registry: Registry, clients: UpstreamClient, metrics: GatewayMetrics,
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
        self.prefixes = PrefixIndex()
        self.flow = FlowControl(config.max_queue_length, config.queue_timeout_s, config.retry_after_s,
                                choose=lambda job: self.choose(job, set()), hold=_hold, unhold=_unhold,
                                on_depth=self._on_queue_depth,
                                on_wait=lambda model, waited: metrics.queue_wait.labels(model).observe(waited),
                                max_bytes=config.max_queue_bytes)
        registry.listeners.append(self._engine_changed)

    def _on_queue_depth(self, model: str, depth: int) -> None:
        self.metrics.queue_depth.labels(model).set(depth)
        self.metrics.queue_drain_rate.labels(model).set(self.flow.drain_rate(model) or 0.0)

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
        elif cfg.routing == "prefix-aware" and job.prefix:
            matches = [self.prefixes.match(b.url, job.prefix) for b in backends]
            chosen = pick_prefix_aware(candidates, matches, cfg.metrics_stale_s, self.rng)
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

    def _engine_changed(self, backend: Backend, event: str) -> None:
        if event in ("admitted", "removed"):
            self.prefixes.forget(backend.url)  # a readmitted engine may have restarted with an empty cache
        if event != "removed":
            for model in backend.models:
                self.flow.dispatch(model)

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
            # The first attempt may wait in the model's queue; the engine comes with a hold on it.
            backend = await self._place(job) if attempt == 0 else self.choose(job, tried)
            if backend is None:
                break
            tried.add(backend.url)
            if job.prefix:
                self.prefixes.record(backend.url, job.prefix)
            if attempt:
                self.metrics.retries.labels(reason.split(":")[0]).inc()
            if budgeted:
                self.budget.retrying += 1
            try:
                if attempt == 0:
                    # The hold ends where the attempt counts the request, with no await in between: the
                    # next queued request never sees the engine emptier than it is.
                    _unhold(backend)
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
        self.metrics.requests_refused.labels("unavailable").inc()
        raise GatewayError(503, message, retry_after=self.config.retry_after_s)

    async def _place(self, job: Job) -> Backend | None:
        """An engine for the first attempt, held (see `FlowControl`): at once when one has room and
        nobody queues before; else after waiting in the model's queue. None when queueing is off
        (--max-queue-length 0) and no engine has room. Sheddable requests never wait: 503."""
        if not self.flow.depth(job.model):
            backend = self.choose(job, set())
            if backend is not None:
                _hold(backend)
                return backend
        if not self.config.max_queue_length:
            return None
        if job.sheddable:
            self.metrics.requests_refused.labels("sheddable").inc()
            state = "is saturated" if self.registry.healthy(job.model) else "is down"
            raise GatewayError(503, f"every engine serving {job.model!r} {state}, and this request is sheddable "
                                    "(x-gateway-priority < 0); retry later", retry_after=self.config.retry_after_s)
        try:
            return await self.flow.wait(job, job.model, job.priority, job.rate_key, job.disconnected,
                                        len(job.body) + QUEUED_REQUEST_OVERHEAD_BYTES)
        except QueueRefused as refused:
            if refused.reason != "client_disconnected":
                self.metrics.requests_refused.labels(refused.reason).inc()
            raise refused.error from None

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
                    response.close()
                self._track(backend, -1)

        try:
            response, first = await self._first_byte(backend, job)
            metrics.upstream_latency.labels(job.route, "first_byte").observe(time.monotonic() - started)
            content_type = response.headers.get("content-type", "application/json")
            if response.status_code >= 500:
                body = b"" if first is None else first + await self._rest(response, engine)
                raise self._engine_failed(backend, job, response.status_code, body, response.headers)
            if content_type.startswith("text/event-stream"):
                handed_off = True  # released when the stream ends
                return Relayed(response.status_code, release,
                               functools.partial(self._relay, backend, job, response, first, started), response.close)
            body = b"" if first is None else first + await self._rest(response, engine)
            metrics.upstream_latency.labels(job.route, "total").observe(time.monotonic() - started)
            metrics.upstream_requests.labels(engine, "ok").inc()
            backend.breaker.on_success()
            if response.status_code == 200:
                self._settle_from_json(job, body)
            return Response(body, status_code=response.status_code, media_type=content_type)
        except GatewayError as error:
            self._breaker_failure(backend, error)
            raise
        finally:
            if not handed_off:
                await release()

    async def _first_byte(self, backend: Backend, job: Job) -> tuple[UpstreamResponse, bytes | None]:
        """Send the request; (response, first body bytes or None). Raises `_Retry` when the engine did
        not accept it, GatewayError when it did and then failed, timed out or was ejected as
        unresponsive.

        The first-byte timeout measures the engine's silence, not this request's wait: it fires when
        the engine sent nothing at all, to any request of this gateway, for the timeout while this one
        waited. A request waiting its turn in the engine's own queue behind others that stream is
        waiting, not unanswered (the engine says nothing per request until it is scheduled)."""
        cfg = self.config
        engine = backend.url
        sending = asyncio.ensure_future(self._send(backend, job))
        ejected = backend.unresponsive_signal()
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        done: set = set()
        try:
            while True:
                remaining = max(sent_at, self.clients.heard_at(engine)) + cfg.first_byte_timeout_s - loop.time()
                if remaining <= 0:
                    break
                done, _ = await asyncio.wait((sending, ejected), timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
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
            except ConnectFailed as error:
                self.registry.eject(backend, f"connect failed: {error}")
                raise self._fail(engine, "error", "connect") from None
            except ConnectTimeout:
                raise self._fail(engine, "timeout", "connect_timeout") from None
            except WriteFailed:  # the engine never read the whole request, so it cannot have started it
                raise self._fail(engine, "error", "write") from None
            except UpstreamError as error:
                self.metrics.upstream_requests.labels(engine, "error").inc()
                log.warning("engine %s lost request %s after accepting it: %s", engine, job.request_id, error)
                raise GatewayError(502, "the engine closed the connection before answering (not retried: "
                                        "it may have started the request)", retry_after=cfg.retry_after_s) from None
        self.metrics.upstream_requests.labels(engine, "timeout").inc()
        if ejected in done:
            raise GatewayError(503, "the engine stopped answering and was taken out of rotation (not retried: it "
                                    "may have started the request)", retry_after=cfg.retry_after_s)
        raise GatewayError(504, f"the engine sent nothing for {cfg.first_byte_timeout_s:g}s while this request "
                                "waited for its answer (not retried: it may have started the request)")

    async def _send(self, backend: Backend, job: Job) -> tuple[UpstreamResponse, bytes | None]:
        response = await self.clients.post(backend.url, job.path, job.headers, job.body)
        try:
            if response.status_code == 503 and RETRYABLE_HEADER in response.headers:
                raise _Retry("status 503")
            return response, await response.read()
        except BaseException:
            response.close()
            raise

    async def _rest(self, response: UpstreamResponse, engine: str) -> bytes:
        """The rest of a plain (not streamed) answer, within the idle timeout between two reads."""
        parts = []
        while True:
            try:
                part = await response.read(self.config.idle_timeout_s)
            except IdleTimeout:
                self.metrics.upstream_requests.labels(engine, "timeout").inc()
                raise GatewayError(504, f"the engine's answer stalled for {self.config.idle_timeout_s:g}s") from None
            except UpstreamError:
                self.metrics.upstream_requests.labels(engine, "error").inc()
                raise GatewayError(502, "the connection to the engine was lost mid-answer (not retried)") from None
            if part is None:
                return b"".join(parts)
            parts.append(part)

    def _engine_failed(self, backend: Backend, job: Job, status: int, body: bytes, headers) -> GatewayError:
        self.metrics.upstream_requests.labels(backend.url, "error").inc()
        log.warning("engine %s answered %d to request %s: %s", backend.url, status, job.request_id,
                    body[:ENGINE_MESSAGE_LOG_CHARS].decode(errors="replace"))
        if status == 500 and REQUEST_FAULT_HEADER in headers:
            return RequestFault(500, "the engine failed while serving this request and reports the request as the "
                                     "cause (not retried)")
        if status == 503:
            return GatewayError(503, "the engine could not serve this request (not retried: it may have started "
                                     "it)", retry_after=self.config.retry_after_s)
        return GatewayError(502, f"the engine failed with status {status} while serving this request "
                                 "(not retried: it may have started it)")

    def _breaker_failure(self, backend: Backend, error: GatewayError | None = None) -> None:
        """Counts a failed attempt against the engine, as Envoy's outlier detection counts connection
        failures, resets, timeouts and 5xx; a 500 the engine attributes to the request proves the engine
        answering, like a success (a client repeating such a request cannot open the breaker)."""
        if isinstance(error, RequestFault):
            backend.breaker.on_success()
            return
        if backend.breaker.on_failure(time.monotonic()):
            self.metrics.breaker_opened.labels(backend.url).inc()
            log.warning("engine %s: circuit breaker open for %gs after %d failed requests", backend.url,
                        self.config.breaker_cooldown_s, backend.breaker.failures)

    def _track(self, backend: Backend, delta: int) -> None:
        backend.in_flight += delta
        if self.registry.backends.get(backend.url) is backend:  # a forgotten engine has no series any more
            self.metrics.upstream_in_flight.labels(backend.url).inc(delta)
        if delta < 0:  # a request ended: room for a queued one
            for model in backend.models:
                self.flow.dispatch(model)

    def _fail(self, engine: str, outcome: str, reason: str) -> _Retry:
        self.metrics.upstream_requests.labels(engine, outcome).inc()
        return _Retry(reason)

    async def _relay(self, backend: Backend, job: Job, response: UpstreamResponse, first: bytes | None,
                     started: float, send, relayed: Relayed) -> None:
        """Pass SSE through as it comes, whole events only, so an error event never lands inside a
        half-written one. Per chunk: one read of what the connection holds, one ASGI send; the body is
        searched for usage only when a token limit needs it."""
        metrics = self.metrics
        engine = backend.url
        idle = self.config.idle_timeout_s
        usage = bool(self.limiter.tpm)
        pending = b""
        chunk = first
        outcome = "ok"
        tail = b""
        try:
            while chunk is not None:
                if not pending and chunk.endswith(b"\n\n"):
                    complete = chunk
                else:
                    pending += chunk
                    cut = pending.rfind(b"\n\n") + 2
                    complete, pending = (pending[:cut], pending[cut:]) if cut > 1 else (b"", pending)
                if complete:
                    if usage and b'"usage"' in complete:
                        self._settle_from_sse(job, complete)
                    await send({"type": "http.response.body", "body": complete, "more_body": True})
                chunk = await response.read(idle)
            tail = pending
        except IdleTimeout:
            outcome = "timeout"
            metrics.stream_errors.labels("idle_timeout").inc()
            tail = sse_error_event(504, f"the engine sent nothing for {idle:g}s; stream ended", job.route)
        except UpstreamError as error:
            if relayed.gone:  # the client left and its upstream connection was closed for it
                return
            outcome = "error"
            metrics.stream_errors.labels("upstream_lost").inc()
            log.warning("stream from %s broke: %s", engine, error)
            tail = sse_error_event(502, "the connection to the engine was lost mid-stream", job.route)
        finally:
            metrics.upstream_requests.labels(engine, outcome).inc()
            metrics.upstream_latency.labels(job.route, "total").observe(time.monotonic() - started)
            if outcome == "ok":
                backend.breaker.on_success()
            else:
                self._breaker_failure(backend)
        relayed.finished = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    # ---- token accounting ---------------------------------------------------------------------------
    def _settle(self, job: Job, usage) -> None:
        if not isinstance(usage, dict) or job.settled:
            return
        total = usage.get("total_tokens")
        if total is None and isinstance(usage.get("input_tokens"), int) and isinstance(usage.get("output_tokens"), int):
            # /v1/messages: Anthropic's usage has no total; the prompt is input plus cache reads
            total = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + usage["output_tokens"]
        if isinstance(total, int):
            job.settled = True
            self.limiter.settle(job.rate_key, job.estimated_tokens, total)

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
            if line.startswith(b"data: {") and b'"usage"' in line and b'"type":"message_start"' not in line:
                try:
                    self._settle(job, json.loads(line[6:]).get("usage"))
                except (ValueError, AttributeError):
                    pass


def _hold(backend: Backend) -> None:
    """Count a request handed to a queued client on its engine before its attempt does."""
    backend.in_flight += 1


def _unhold(backend: Backend) -> None:
    backend.in_flight -= 1


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
