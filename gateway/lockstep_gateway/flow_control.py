"""Flow control: a queue per model that holds requests while no engine can take them, sized by
what the engines can serve.

A request waits here instead of being refused when every engine of its model is saturated, or when
the model is known but has no healthy engine right now (a restart, or a model scaled to zero: the
queue is its waiting room). It leaves the queue the moment an engine has room: a request on that
model ended, a load scrape arrived, an engine became healthy. Routing happens at dispatch, not at
arrival, so the engine is chosen with the load of that moment.

Order: priority first, then arrival, and within one priority round robin over the tenants (API
keys, or client addresses without keys) that have queued requests, so one tenant's burst cannot
starve another. Priority has vLLM's meaning (the body's `priority`: lower is served earlier,
default 0); a platform can set the header `x-gateway-priority` instead, with the Gateway API
Inference Extension's meaning (higher is more important, negative is sheddable), taken as the body
priority of its negation. Only trusted sources set priority (`PriorityTrust`): from anyone else the
header is ignored and a body priority can only make the request less urgent. Sheddable requests
never queue: they get 503 at once when no engine can take them.

Admission is decided once, on arrival (`FlowControl.admission`): a request is queued when the
model's engines can be expected to reach it within `timeout_s` at their measured drain rate
(`DrainRate`: requests per second leaving the queue while it has a backlog, which is the engines'
throughput), and when it fits the bounds (`max_length` requests per model, `max_bytes` of queued
requests over all models). Otherwise 429 with a Retry-After from the drain rate. A queued request is
not timed out because the queue turned out long: it waits while the queue moves, and gets 429 only
when no request of its model left the queue for `timeout_s` (the engines are gone or stuck). With
no measurement yet (the first burst) the bounds alone decide. A client that disconnects while
queued leaves at once.

The queue holds no engine state of its own: `dispatch(model)` asks the chooser for an engine for
the request at the head and hands the engine over with a hold on it (its in-flight count is raised
at once, so the next request at the head sees it fuller), until the chooser finds no room.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lockstep_gateway.errors import GatewayError

PRIORITY_HEADER = "x-gateway-priority"
PRIORITY_LIMIT = 2**63  # the engine's `priority` is a 64-bit integer
# nginx's "client closed request": never reaches the client, only the gateway's own metrics.
CLIENT_CLOSED = 499
# What a queued request holds in the gateway besides its body: its client connection, its request
# task, the Job and the Waiter (measured with 10,000 queued: docs/GATEWAY.md, "Admission").
QUEUED_REQUEST_OVERHEAD_BYTES = 28 << 10
# The drain rate follows the engines of the last half-minute or so.
DRAIN_TIME_CONSTANT_S = 30.0
# A rate is trusted after this many requests left a backlog over at least this much backlogged time
# (from the first one that left: the wait for a batch's first answers is not the engines' pace).
MIN_DRAINED = 16
MIN_DRAIN_SPAN_S = 1.0


def request_priority(headers, payload: dict, trusted: bool = True) -> tuple[int, bool]:
    """(priority, sheddable) of a request: lower priority is served earlier.

    From a trusted source the header `x-gateway-priority: N` (higher = more important, negative =
    sheddable) wins over the body's `priority` (vLLM's: lower first) and counts as `priority: -N`.
    From any other source the header is ignored, and a body priority below 0 counts as 0: an
    untrusted client can make its own request less urgent, never more."""
    value = headers.get(PRIORITY_HEADER)
    if value is not None and trusted:
        try:
            importance = int(value.strip())
        except ValueError:
            importance = None
        if importance is None or not -PRIORITY_LIMIT <= importance < PRIORITY_LIMIT:
            raise GatewayError(400, f"the header {PRIORITY_HEADER}={value!r} is not allowed: an integer "
                                    "(higher is served earlier, negative may be shed under load)", PRIORITY_HEADER)
        return -importance, importance < 0
    priority = payload.get("priority", 0)
    if priority is None:
        return 0, False
    if isinstance(priority, bool) or not isinstance(priority, int) or not -PRIORITY_LIMIT <= priority < PRIORITY_LIMIT:
        raise GatewayError(400, f"'priority'={priority!r} is not allowed: an integer (lower is served earlier)",
                           "priority")
    return (priority if trusted else max(priority, 0)), False


class PriorityTrust:
    """Who may raise a request's priority: requests with one of `key_ids` (API keys configured for it),
    or from a peer in `proxies` (a platform proxy that sets the header from its own configuration, as
    the Gateway API Inference Extension takes priority from an InferenceObjective, not the caller)."""

    def __init__(self, key_ids: Iterable[str] = (), proxies: Iterable[str] = ()):
        self.key_ids = frozenset(key_ids)
        self.networks = [ipaddress.ip_network(proxy, strict=False) for proxy in proxies]

    def trusts(self, key_id: str | None, peer: str | None) -> bool:
        if key_id is not None and key_id in self.key_ids:
            return True
        if not self.networks or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self.networks)


def disconnect_watcher(receive) -> Callable[[], Awaitable[None]]:
    """An awaitable factory that returns once the ASGI `receive` channel says the client has gone
    (the body was read before, so nothing else arrives on it)."""
    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return disconnected


@dataclass(eq=False)
class Waiter:
    """One queued request."""

    job: Any
    priority: int
    tenant: str
    arrival: float
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    size: int = 0  # bytes it holds while queued (FlowControl's memory budget)
    queued: bool = True  # False once it left; a waiter removed out of turn stays in its deque until reached


class ModelQueue:
    """The queued requests of one model: bands by priority (lowest first), and in each band a
    rotation over tenants, each tenant's requests in arrival order. A waiter removed out of turn
    (timed out, client gone) is only marked and skipped when reached, so removal costs O(1) at any
    depth."""

    def __init__(self) -> None:
        self.bands: dict[int, OrderedDict[str, deque[Waiter]]] = {}
        self.band_sizes: dict[int, int] = {}  # queued waiters per band, marked ones not counted
        self.size = 0

    def push(self, waiter: Waiter) -> None:
        band = self.bands.setdefault(waiter.priority, OrderedDict())
        band.setdefault(waiter.tenant, deque()).append(waiter)
        self.band_sizes[waiter.priority] = self.band_sizes.get(waiter.priority, 0) + 1
        waiter.queued = True
        self.size += 1

    def head(self) -> Waiter | None:
        """The request to serve next: the most urgent band, the tenant whose turn it is, its oldest."""
        while self.size:
            priority = min(self.bands)
            band = self.bands[priority]
            tenant = next(iter(band))
            waiters = band[tenant]
            if waiters[0].queued:
                return waiters[0]
            waiters.popleft()  # removed out of turn before
            self._tidy(priority, band, tenant, waiters)
        return None

    def pop_head(self) -> Waiter:
        """Take the head; its tenant goes to the end of the band's rotation."""
        waiter = self.head()
        priority = waiter.priority
        band = self.bands[priority]
        waiters = band[waiter.tenant]
        waiters.popleft()
        waiter.queued = False
        self.band_sizes[priority] -= 1
        self.size -= 1
        if waiters:
            band.move_to_end(waiter.tenant)
        self._tidy(priority, band, waiter.tenant, waiters)
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out wherever it is (timed out, client gone); False when it was not queued."""
        if not waiter.queued or waiter.priority not in self.bands:
            return False
        waiter.queued = False
        waiter.job = None  # its body is not held until the mark is reached
        self.band_sizes[waiter.priority] -= 1
        self.size -= 1
        return True

    def ahead_of(self, priority: int) -> int:
        """Queued requests served before a new one of `priority` (its band's and the more urgent)."""
        return sum(size for band, size in self.band_sizes.items() if band <= priority)

    def _tidy(self, priority: int, band: OrderedDict, tenant: str, waiters: deque) -> None:
        if not waiters:
            del band[tenant]
        if not band:
            del self.bands[priority]
            del self.band_sizes[priority]

    def __len__(self) -> int:
        return self.size


class DrainRate:
    """Requests per second that leave one model's queue while it has a backlog. With a backlog a
    request leaves exactly when an engine has room again, so this is what the engines serve, whatever
    the demand. The backlogged time and the count both decay with `DRAIN_TIME_CONSTANT_S`, so the
    rate follows the engines now (one added or lost). Backlogged time counts from the first request
    that left the current backlog: the wait for a batch's first answers is not the engines' pace."""

    def __init__(self, now: float) -> None:
        self.count = 0.0
        self.span = 0.0  # decayed backlogged seconds since the backlog's first departure
        self.updated = now
        self.draining = False  # a request left the current backlog
        self.progressed_at = now  # the last departure (or the creation): what the queue timeout measures

    def advance(self, now: float, backlogged: bool) -> None:
        """Account for the time since the last call, during which the queue was `backlogged` or not."""
        elapsed = now - self.updated
        if elapsed > 0:
            keep = math.exp(-elapsed / DRAIN_TIME_CONSTANT_S)
            self.count *= keep
            self.span = self.span * keep + (DRAIN_TIME_CONSTANT_S * (1 - keep) if backlogged and self.draining else 0)
            self.updated = now

    def emptied(self) -> None:
        """The backlog is over: the next one's span starts at its first departure."""
        self.draining = False

    def departed(self, now: float, count: int) -> None:
        self.count += count
        self.draining = True
        self.progressed_at = now

    def per_second(self) -> float | None:
        """The measured rate, or None while too little has left a backlog to say."""
        if self.count < MIN_DRAINED or self.span < MIN_DRAIN_SPAN_S:
            return None
        return self.count / self.span


class FlowControl:
    """The per-model queues of one gateway process.

    `choose(job)` is the router: the engine for the job now, or None while no engine has room.
    `hold(backend)` / `unhold(backend)` count a request handed to a waiter on its engine until its
    attempt counts it; `on_depth(model, depth)` and `on_wait(model, seconds)` feed the metrics."""

    def __init__(self, max_length: int, timeout_s: float, retry_after_s: int, choose: Callable[[Any], Any],
                 hold: Callable[[Any], None], unhold: Callable[[Any], None],
                 on_depth: Callable[[str, int], None], on_wait: Callable[[str, float], None], max_bytes: int = 0):
        self.max_length = max_length
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.queues: dict[str, ModelQueue] = {}
        self.drains: dict[str, DrainRate] = {}
        self.queued_bytes = 0  # over all models: memory is the process's
        self._choose = choose
        self._hold = hold
        self._unhold = unhold
        self._on_depth = on_depth
        self._on_wait = on_wait

    def depth(self, model: str) -> int:
        queue = self.queues.get(model)
        return len(queue) if queue is not None else 0

    def drain_rate(self, model: str) -> float | None:
        drain = self.drains.get(model)
        return None if drain is None else drain.per_second()

    def dispatch(self, model: str) -> None:
        """Hand engines to the model's queued requests, in order, while the router finds room."""
        queue = self.queues.get(model)
        if not queue:
            return
        now = time.monotonic()
        departed = 0
        while queue:
            waiter = queue.head()
            backend = self._choose(waiter.job)
            if backend is None:
                break
            if not departed:
                self.drains[model].advance(now, True)
            queue.pop_head()
            departed += 1
            self.queued_bytes -= waiter.size
            self._hold(backend)
            waiter.granted.set_result(backend)
            self._on_wait(model, now - waiter.arrival)
        if departed:
            self.drains[model].departed(now, departed)
            if not queue:
                self.drains[model].emptied()
        self._on_depth(model, len(queue))

    def admission(self, model: str, priority: int, size: int) -> QueueRefused | None:
        """Whether a request of `priority` holding `size` bytes may join `model`'s queue: None, or the
        refusal with a Retry-After from the drain rate (`--retry-after` while none is measured)."""
        queue = self.queues.get(model) or ModelQueue()
        rate = self.drain_rate(model)
        depth = len(queue)
        if self.max_length and depth >= self.max_length:
            return self._refusal("queue_full", f"{depth} requests for {model!r} are queued already "
                                               "(--max-queue-length)", depth - self.max_length + 1, rate)
        if self.max_bytes and self.queued_bytes + size > self.max_bytes:
            queued = sum(len(q) for q in self.queues.values())
            over = math.ceil((self.queued_bytes + size - self.max_bytes) / max(1, self.queued_bytes / max(1, queued)))
            return self._refusal("queue_memory", f"the queued requests hold {self.queued_bytes >> 20} MiB, and "
                                                 f"this one does not fit in {self.max_bytes >> 20} MiB "
                                                 "(--max-queue-bytes)", over, rate)
        if rate is not None:
            ahead = queue.ahead_of(priority)
            expected = (ahead + 1) / rate
            if expected > self.timeout_s:
                return self._refusal(
                    "queue_wait", f"{ahead} requests for {model!r} are queued ahead of this one: at the {rate:.3g} "
                                  f"requests/s its engines serve, it would wait {expected:.0f}s, longer than "
                                  f"{self.timeout_s:g}s (--queue-timeout)", math.ceil(ahead + 1 - rate * self.timeout_s),
                    rate)
        return None

    def _refusal(self, reason: str, message: str, excess: int, rate: float | None) -> QueueRefused:
        """429 with Retry-After: when `excess` more requests will have left at `rate`."""
        retry_after = self.retry_after_s if rate is None else max(1, math.ceil(excess / rate))
        return QueueRefused(reason, GatewayError(429, f"{message}; retry in {retry_after}s", retry_after=retry_after))

    async def wait(self, job, model: str, priority: int, tenant: str,
                   disconnected: Callable[[], Awaitable[None]] | None, size: int = 0):
        """Queue `job` until an engine is handed to it (returned with a hold on it, which the caller
        ends as its attempt starts: `unhold`). Raises QueueRefused: 429 when it is not admitted or the
        queue stopped moving for the timeout, 499 when the client went away."""
        refused = self.admission(model, priority, size)
        if refused is not None:
            raise refused
        queue = self.queues.setdefault(model, ModelQueue())
        now = time.monotonic()
        drain = self.drains.setdefault(model, DrainRate(now))
        drain.advance(now, bool(queue))
        waiter = Waiter(job, priority, tenant, now, size=size)
        queue.push(waiter)
        self.queued_bytes += size
        self._on_depth(model, len(queue))
        self.dispatch(model)  # an engine may have room already: then no wait at all
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None and not waiter.granted.done() \
            else None
        waiting = [waiter.granted] if watcher is None else [waiter.granted, watcher]
        try:
            # Timed out only when the queue stopped moving: no request of the model left it for the timeout.
            while not any(future.done() for future in waiting):
                remaining = max(waiter.arrival, drain.progressed_at) + self.timeout_s - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._leave(model, queue, waiter)
            raise
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
        if waiter.granted.done() and not (watcher is not None and watcher.done()):
            return waiter.granted.result()
        self._leave(model, queue, waiter)
        if watcher is not None and watcher.done():
            raise QueueRefused("client_disconnected", GatewayError(
                CLIENT_CLOSED, "the client closed the connection while the request was queued"))
        raise QueueRefused("queue_timeout", GatewayError(
            429, f"no request for {model!r} left the queue within {self.timeout_s:g}s (--queue-timeout): no engine "
                 "serving it had room; retry later", retry_after=self.retry_after_s))

    def _leave(self, model: str, queue: ModelQueue, waiter: Waiter) -> None:
        """The waiter gives up: out of the queue, or, if an engine was handed to it meanwhile, the
        hold ends and the next request gets the room."""
        if queue.remove(waiter):
            self.queued_bytes -= waiter.size
            if not queue:
                self.drains[model].advance(time.monotonic(), True)
                self.drains[model].emptied()
            self._on_depth(model, len(queue))
            return
        self._unhold(waiter.granted.result())  # not queued any more: it was handed an engine
        self.dispatch(model)


class QueueRefused(Exception):
    """The queue gave up on a request; `reason` labels the refusal metric, `error` is the answer."""

    def __init__(self, reason: str, error: GatewayError):
        super().__init__(reason)
        self.reason = reason
        self.error = error
