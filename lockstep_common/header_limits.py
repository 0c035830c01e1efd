"""The HTTP/1.1 front door of the engine and the gateway alike: a deadline for request headers, a size limit on
them, and OpenAI-shaped answers to what cannot be parsed.

uvicorn closes idle keep-alive connections, but a connection that sends part of its headers and then nothing
stays open for ever: a few hundred of them (slowloris) hold file descriptors and memory. Here every request's
headers must be complete within `header_timeout_s` of its first byte (or of the connection's start; a connection
the health listener passed on with its headers incomplete keeps the deadline that started there,
`header_deadline`, time.monotonic()); otherwise the connection is closed. Headers past `max_header_bytes` get a
431, a request that is not HTTP/1.1 a 400, both with the `{"error": {...}}` body every other error has (not
uvicorn's plain text), and the connection closes after either.

`HeaderLimits` is a mixin for a uvicorn HTTP protocol class, standard library only: `HttptoolsHeaderLimits` puts it
on uvicorn's httptools protocol (the gateway's, and the engine's when httptools is installed), the engine's h11
protocol has its own (engine/lockstep_engine/api/http_limits.py); each parser says, through `request_started` and
`headers_complete`, where a request's headers begin and end, and sends the parser's own refusals through
`send_400_response`.
"""

from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus

from lockstep_common.errors import error_body

DEFAULT_HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 << 10  # a request line and headers larger than this get 431
INVALID_HTTP_MESSAGE = ("the request is not valid HTTP/1.1: a malformed request line or header, or a body that "
                        "does not match its Content-Length")


def headers_size(target: bytes, headers) -> int:
    """What a request's line and headers count against the limit: the target and each `name: value\\r\\n`."""
    return len(target) + sum(len(name) + len(value) + 4 for name, value in headers)


class HeaderLimits:
    """Put before the uvicorn protocol class in the bases; `header_timeout_s` and `max_header_bytes` are set on the
    class (the health listener reads the timeout there), `header_deadline` on a connection."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes = MAX_HEADER_BYTES
    header_deadline: float | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _oversized = False

    def request_started(self) -> None:
        """A request's first bytes arrived (the next one on a kept-alive connection): its headers' clock starts."""
        if self._header_timer is None:
            self._arm()

    def headers_complete(self, size: int | None = None) -> bool:
        """The parser has the headers (`size`: what they count, when it can tell); False when they are over the
        limit, which the parser then refuses (`send_400_response` answers the 431)."""
        self._disarm()
        if size is not None and size > self.max_header_bytes:
            self._oversized = True
        return not self._oversized

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.header_deadline)

    def data_received(self, data: bytes) -> None:
        # Judged after parsing: a chunk can carry complete headers and a large body together (an 80 kB body
        # was once a 431); only a chunk that leaves the headers incomplete is over the limit.
        if self._header_timer is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        if (self._header_timer is not None and self._header_bytes > self.max_header_bytes
                and not self.transport.is_closing()):
            self.send_error(431, self._too_large())

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls for a request its parser refuses: the 431 when the headers were over the limit."""
        if self._oversized or (self._header_timer is not None and self._header_bytes > self.max_header_bytes):
            self.send_error(431, self._too_large())
        else:
            self.send_error(400, INVALID_HTTP_MESSAGE)

    def send_error(self, status: int, message: str) -> None:
        self._disarm()
        body = json.dumps(error_body(status, message)).encode()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
        head.extend(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    def _too_large(self) -> str:
        return f"the request's headers are larger than {self.max_header_bytes} bytes"

    def _arm(self, deadline: float | None = None) -> None:
        self._disarm()
        delay = self.header_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        self._header_timer = self.loop.call_later(delay, self._headers_too_slow)
        self._header_bytes = 0

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class HttptoolsHeaderLimits(HeaderLimits):
    """`HeaderLimits` wired to uvicorn's httptools protocol: put it before `HttpToolsProtocol` in the bases."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.request_started()  # the next request on a kept-alive connection

    def on_headers_complete(self) -> None:
        # Headers that arrived complete in one chunk (as they do from the health listener, which only peeked at
        # them) are measured here, by what the parser took: the request line's target and each header.
        if not self.headers_complete(headers_size(self.url, self.headers)):
            raise ValueError("headers over the limit")  # stops the parser: uvicorn calls send_400_response
        super().on_headers_complete()
