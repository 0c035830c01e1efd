"""The engine's HTTP/1.1 protocol: uvicorn's httptools protocol when httptools is installed (as uvicorn's own
`http="auto"` picks, and vLLM's server with it), else its h11 protocol, either with the header deadline, header
size limit and OpenAI-shaped protocol errors of lockstep_common.header_limits, the same the gateway puts on its
protocol (a slow client's connection closes, headers past the limit get a 431, unparsable requests a 400).

httptools parses in C and writes a streamed chunk straight to the transport; h11 does both in Python. A
streamed token costs the API process about 40% less CPU with it (docs/BENCHMARKS.md, "the engine's HTTP parser").

The limit is `--h11-max-incomplete-event-size` when given (vLLM's flag, which sets h11's own buffer limit; here
the header limit of either parser), else the shared one: h11's own default (16 KiB) would otherwise refuse
smaller headers first.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lockstep_common.header_limits import MAX_HEADER_BYTES, HeaderLimits, HttptoolsHeaderLimits, headers_size

PARSERS = ("auto", "httptools", "h11")


def header_timeout_protocol(timeout_s: float, parser: str = "auto") -> type:
    """The protocol class for uvicorn's `http=`: `parser` "httptools", "h11", or "auto" (httptools if installed)."""
    if parser not in PARSERS:
        raise ValueError(f"parser: {parser!r} is not one of {', '.join(PARSERS)}")
    if parser == "auto":
        parser = "httptools" if _httptools_installed() else "h11"
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class HeaderTimeoutHttptoolsProtocol(HttptoolsHeaderLimits, HttpToolsProtocol):
            header_timeout_s = timeout_s

            def __init__(self, config, *args, **kwargs) -> None:
                super().__init__(config, *args, **kwargs)
                self.max_header_bytes = config.h11_max_incomplete_event_size or MAX_HEADER_BYTES

        return HeaderTimeoutHttptoolsProtocol

    class HeaderTimeoutH11Protocol(_H11HeaderLimits):
        header_timeout_s = timeout_s

    return HeaderTimeoutH11Protocol


def _httptools_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("httptools") is not None


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
