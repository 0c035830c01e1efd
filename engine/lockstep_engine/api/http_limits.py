"""uvicorn's h11 protocol with a deadline for request headers.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`), but a connection that sends part
of its headers and then nothing stays open for ever: a few hundred of them (slowloris) hold file
descriptors and memory. Here every request's headers must be complete within `header_timeout_s` of
its first byte (or of the connection's start); otherwise the connection is closed. A connection that
the health listener (`api/health_listener.py`) passed on with its headers incomplete keeps the deadline
that started there (`header_deadline`, time.monotonic()).
"""

from __future__ import annotations

import asyncio
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

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
