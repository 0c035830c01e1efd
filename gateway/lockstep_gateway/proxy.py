"""Forwarding one client request: choose an engine (routing/), retry only what no engine accepted, relay
SSE (relay.py), correct the token charge with the usage the engine reports (token_usage.py).

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
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from starlette.responses import Response

from lockstep_gateway.backends import Backend, Registry
from lockstep_gateway.breaker import RetryBudget
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.errors import GatewayError
from lockstep_gateway.flow_control import QUEUED_REQUEST_OVERHEAD_BYTES, FlowControl, QueueRefused
from lockstep_gateway.metrics import GatewayMetrics
from lockstep_gateway.ratelimit import RateLimiter
from lockstep_gateway.relay import Relayed, relay_events
from lockstep_gateway.routing.candidate import Ask, Settings
from lockstep_gateway.routing.registry import build_policy
from lockstep_gateway.routing.router import Router
from lockstep_gateway.token_usage import settle_from_json, settle_from_sse
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
    rate_key: str
    estimated_tokens: int
    request_id: str = ""
    settled: bool = False  # the engine reported usage and the rate limiter was corrected
    priority: int = 0  # lower is served earlier (vLLM's `priority`; flow_control.request_priority)
    sheddable: bool = False  # refused at once rather than queued when no engine has room
    hints: dict[str, object] = field(default_factory=dict)  # what routing read of it (Router.read)
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


class Proxy:
    def __init__(self, config: GatewayConfig, registry: Registry, clients: UpstreamClient, metrics: GatewayMetrics,
                 limiter: RateLimiter, rng: random.Random | None = None):
        self.config = config
        self.registry = registry
        self.clients = clients
        self.metrics = metrics
        self.limiter = limiter
        settings = Settings(stale_after_s=config.metrics_stale_s, queue_depth=config.saturation_queue_depth,
                            max_in_flight=config.max_in_flight_per_engine, session_header=config.session_header,
                            session_affinity=config.session_affinity)
        self.router = Router(build_policy(config.routing, settings), settings, rng)
        self.in_flight = 0  # client requests admitted and not answered yet (streams until their end)
        self.budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min)
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
        """The engine for the job now (routing/), other than the tried ones; None when none may take it."""
        now = time.monotonic()
        backends = self.registry.backends
        chosen = self.router.choose([b.candidate(now) for b in backends.values()],
                                    Ask(job.model, job.hints, frozenset(tried), tuple(backends)))
        return None if chosen is None else backends[chosen.url]

    def _engine_changed(self, backend: Backend, event: str) -> None:
        if event in ("admitted", "removed"):
            self.router.forget(backend.url)  # a readmitted engine may have restarted with an empty cache
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
            self.router.routed(backend.url, job.hints)
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
                settle_from_json(self.limiter, job, body)
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
        on_usage = functools.partial(settle_from_sse, self.limiter, job) if self.limiter.tpm else None
        outcome, tail = "ok", None
        try:
            outcome, tail = await relay_events(response, first, self.config.idle_timeout_s, job.route, send, relayed,
                                               on_usage, self.metrics.stream_errors, backend.url)
        finally:
            self.metrics.upstream_requests.labels(backend.url, outcome).inc()
            self.metrics.upstream_latency.labels(job.route, "total").observe(time.monotonic() - started)
            if outcome == "ok":
                backend.breaker.on_success()
            else:
                self._breaker_failure(backend)
        if tail is not None:
            relayed.finished = True
            await send({"type": "http.response.body", "body": tail, "more_body": False})


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
