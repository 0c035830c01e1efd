"""Relaying a streamed answer: ASGI messages straight from the upstream connection, whole SSE events only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lockstep_gateway.errors import sse_error_event
from lockstep_gateway.upstream import IdleTimeout, UpstreamError
from lockstep_gateway.upstream import Response as UpstreamResponse

log = logging.getLogger("lockstep.gateway")


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


async def relay_events(response: UpstreamResponse, first: bytes | None, idle_timeout_s: float, route: str, send,
                       relayed: Relayed, on_usage: Callable[[bytes], None] | None, stream_errors,
                       engine: str) -> tuple[str, bytes | None]:
    """Pass SSE through as it comes, whole events only, so an error event never lands inside a
    half-written one. Per chunk: one read of what the connection holds, one ASGI send; the events are
    handed to `on_usage` only when they hold a usage (and a token limit needs it: else no `on_usage`).

    Returns the outcome ("ok", "timeout", "error") and the body of the last message, which the caller
    sends after its bookkeeping: what is left of a cut event, or the error event; None when the client
    went away (nothing more to send)."""
    pending = b""
    chunk = first
    try:
        while chunk is not None:
            if not pending and chunk.endswith(b"\n\n"):
                complete = chunk
            else:
                pending += chunk
                cut = pending.rfind(b"\n\n") + 2
                complete, pending = (pending[:cut], pending[cut:]) if cut > 1 else (b"", pending)
            if complete:
                if on_usage is not None and b'"usage"' in complete:
                    on_usage(complete)
                await send({"type": "http.response.body", "body": complete, "more_body": True})
            chunk = await response.read(idle_timeout_s)
        return "ok", pending
    except IdleTimeout:
        stream_errors.labels("idle_timeout").inc()
        return "timeout", sse_error_event(504, f"the engine sent nothing for {idle_timeout_s:g}s; stream ended", route)
    except UpstreamError as error:
        if relayed.gone:  # the client left and its upstream connection was closed for it
            return "ok", None
        stream_errors.labels("upstream_lost").inc()
        log.warning("stream from %s broke: %s", engine, error)
        return "error", sse_error_event(502, "the connection to the engine was lost mid-stream", route)
