"""uvicorn's h11 protocol with a deadline for request headers, and OpenAI-shaped protocol errors.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`), but a connection that sends part
of its headers and then nothing stays open for ever: a few hundred of them (slowloris) hold file
descriptors and memory. Here every request's headers must be complete within `header_timeout_s` of
its first byte (or of the connection's start); otherwise the connection is closed. A connection that
the health listener (`lockstep_common/health_listener.py`) passed on with its headers incomplete keeps the deadline
that started there (`header_deadline`, time.monotonic()).

A request h11 cannot parse (a malformed request line or header, headers past the size limit, a bad
Content-Length) gets the same `{"error": {...}}` body as every other error of this server, not
uvicorn's plain-text "Invalid HTTP request received.".
"""

from __future__ import annotations

import asyncio
import json
import time

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn's h11 protocol imports it
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep_engine.api.errors import error_body

DEFAULT_HEADER_TIMEOUT_S = 10.0


def header_timeout_protocol(timeout_s: float) -> type:
    class HeaderTimeoutH11Protocol(_HeaderTimeoutH11Protocol):
        header_timeout_s = timeout_s

    return HeaderTimeoutH11Protocol


class _HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    header_deadline: float | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer(self.header_deadline)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._awaiting_headers():
            self._arm_header_timer()  # the next request on a kept-alive connection started
        super().data_received(data)
        if not self._awaiting_headers():
            self._cancel_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        body = json.dumps(error_body(400, f"the request is not valid HTTP/1.1: a malformed request line or header, "
                                          f"headers longer than {limit} bytes, or a body that does not match its "
                                          f"Content-Length")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm_header_timer(self, deadline: float | None = None) -> None:
        delay = self.header_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        self._header_timer = self.loop.call_later(delay, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()
