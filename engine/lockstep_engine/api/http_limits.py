"""The engine's HTTP/1.1 protocol: uvicorn's h11 protocol with the header deadline, header size limit and
OpenAI-shaped protocol errors of lockstep_common.header_limits, the same the gateway puts on its httptools
protocol (a slow client's connection closes, headers past the limit get a 431, unparsable requests a 400).

The limit is `--h11-max-incomplete-event-size` when given (vLLM's flag, which sets h11's own buffer limit),
else the shared one: h11's own default (16 KiB) would otherwise refuse smaller headers first.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep_common.header_limits import MAX_HEADER_BYTES, HeaderLimits, headers_size


def header_timeout_protocol(timeout_s: float) -> type:
    class HeaderTimeoutH11Protocol(_H11HeaderLimits):
        header_timeout_s = timeout_s

    return HeaderTimeoutH11Protocol


class _Connection(h11.Connection):
    """h11's server side of a connection, telling the protocol each time a request's headers are parsed."""

    def __init__(self, max_incomplete_event_size: int, on_request) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self._on_request = on_request

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            self._on_request(event)
        return event


class _H11HeaderLimits(HeaderLimits, H11Protocol):
    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.max_header_bytes = config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        self.conn = _Connection(self.max_header_bytes, self._on_request)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self.request_started()  # the next request on a kept-alive connection (no-op while its clock runs)
        super().data_received(data)

    def _on_request(self, event: h11.Request) -> None:
        if not self.headers_complete(headers_size(event.target, event.headers)):
            raise h11.RemoteProtocolError("headers over the limit", error_status_hint=431)  # uvicorn: send_400_response
