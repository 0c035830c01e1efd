"""Flow control: a bounded queue per model that holds requests while no engine can take them.

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
priority of its negation. Sheddable requests never queue: they get 503 at once when no engine can
take them.

Bounds: at most `max_length` requests queued per model (429 past it) and `timeout_s` in the queue
(429 then), both with Retry-After. A client that disconnects while queued leaves at once.

The queue holds no engine state of its own: `dispatch(model)` asks the chooser for an engine for
the request at the head and hands the engine over with a hold on it (its in-flight count is raised
at once, so the next request at the head sees it fuller), until the chooser finds no room.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lockstep_gateway.errors import GatewayError

PRIORITY_HEADER = "x-gateway-priority"
PRIORITY_LIMIT = 2**63  # the engine's `priority` is a 64-bit integer
# nginx's "client closed request": never reaches the client, only the gateway's own metrics.
CLIENT_CLOSED = 499


def request_priority(headers, payload: dict) -> tuple[int, bool]:
    """(priority, sheddable) of a request: lower priority is served earlier.

    The header `x-gateway-priority: N` (higher = more important, negative = sheddable) wins over
    the body's `priority` (vLLM's: lower first) and counts as `priority: -N`. A client can only make
    its own request less urgent with the header, as with the body field."""
    value = headers.get(PRIORITY_HEADER)
    if value is not None:
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
    return priority, False


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


class ModelQueue:
    """The queued requests of one model: bands by priority (lowest first), and in each band a
    rotation over tenants, each tenant's requests in arrival order."""

    def __init__(self) -> None:
        self.bands: dict[int, OrderedDict[str, deque[Waiter]]] = {}
        self.size = 0

    def push(self, waiter: Waiter) -> None:
        band = self.bands.setdefault(waiter.priority, OrderedDict())
        band.setdefault(waiter.tenant, deque()).append(waiter)
        self.size += 1

    def head(self) -> Waiter | None:
        """The request to serve next: the most urgent band, the tenant whose turn it is, its oldest."""
        if not self.size:
            return None
        band = self.bands[min(self.bands)]
        return band[next(iter(band))][0]

    def pop_head(self) -> Waiter:
        """Take the head; its tenant goes to the end of the band's rotation."""
        priority = min(self.bands)
        band = self.bands[priority]
        tenant = next(iter(band))
        waiters = band[tenant]
        waiter = waiters.popleft()
        if waiters:
            band.move_to_end(tenant)
        else:
            del band[tenant]
            if not band:
                del self.bands[priority]
        self.size -= 1
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out wherever it is (timed out, client gone); False when it was not queued."""
        band = self.bands.get(waiter.priority)
        waiters = band.get(waiter.tenant) if band is not None else None
        if waiters is None or waiter not in waiters:
            return False
        waiters.remove(waiter)
        if not waiters:
            del band[waiter.tenant]
            if not band:
                del self.bands[waiter.priority]
        self.size -= 1
        return True

    def __len__(self) -> int:
        return self.size


class FlowControl:
    """The per-model queues of one gateway process.

    `choose(job)` is the router: the engine for the job now, or None while no engine has room.
    `hold(backend)` / `unhold(backend)` count a request handed to a waiter on its engine until its
    attempt counts it; `on_depth(model, depth)` and `on_wait(model, seconds)` feed the metrics."""

    def __init__(self, max_length: int, timeout_s: float, retry_after_s: int, choose: Callable[[Any], Any],
                 hold: Callable[[Any], None], unhold: Callable[[Any], None],
                 on_depth: Callable[[str, int], None], on_wait: Callable[[str, float], None]):
        self.max_length = max_length
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.queues: dict[str, ModelQueue] = {}
        self._choose = choose
        self._hold = hold
        self._unhold = unhold
        self._on_depth = on_depth
        self._on_wait = on_wait

    def depth(self, model: str) -> int:
        queue = self.queues.get(model)
        return len(queue) if queue is not None else 0

    def dispatch(self, model: str) -> None:
        """Hand engines to the model's queued requests, in order, while the router finds room."""
        queue = self.queues.get(model)
        if not queue:
            return
        now = time.monotonic()
        while queue:
            waiter = queue.head()
            backend = self._choose(waiter.job)
            if backend is None:
                break
            queue.pop_head()
            self._hold(backend)
            waiter.granted.set_result(backend)
            self._on_wait(model, now - waiter.arrival)
        self._on_depth(model, len(queue))

    def dispatch_all(self) -> None:
        for model in list(self.queues):
            self.dispatch(model)

    async def wait(self, job, model: str, priority: int, tenant: str,
                   disconnected: Callable[[], Awaitable[None]] | None):
        """Queue `job` until an engine is handed to it (returned with a hold on it, which the caller
        ends as its attempt starts: `unhold`). Raises GatewayError: 429 when the queue is full or
        the timeout passed, 499 when the client went away."""
        queue = self.queues.setdefault(model, ModelQueue())
        if self.max_length and len(queue) >= self.max_length:
            raise QueueRefused("queue_full", GatewayError(
                429, f"{len(queue)} requests for {model!r} are queued already (--max-queue-length); retry later",
                retry_after=self.retry_after_s))
        waiter = Waiter(job, priority, tenant, time.monotonic())
        queue.push(waiter)
        self._on_depth(model, len(queue))
        self.dispatch(model)  # an engine may have room already: then no wait at all
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None and not waiter.granted.done() \
            else None
        try:
            waiting = [waiter.granted] if watcher is None else [waiter.granted, watcher]
            await asyncio.wait(waiting, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
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
            429, f"no engine serving {model!r} had room within {self.timeout_s:g}s (--queue-timeout); retry later",
            retry_after=self.retry_after_s))

    def _leave(self, model: str, queue: ModelQueue, waiter: Waiter) -> None:
        """The waiter gives up: out of the queue, or, if an engine was handed to it meanwhile, the
        hold ends and the next request gets the room."""
        if queue.remove(waiter):
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
