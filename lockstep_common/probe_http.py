"""The little HTTP/1.1 the health listener speaks: it recognises a plain `GET /health` and writes the answer the
server would write; anything else is left for the server.

Stricter than any server behind it (uvicorn's h11 and httptools protocols), never more lenient: a probe is a
request line `GET <path> HTTP/1.1` (or 1.0) with a probe path exactly, then header lines `name: value` with a
token for the name and visible characters, spaces and tabs for the value, each ended by CRLF, then an empty
line, within `PROBE_MAX_BYTES`. No body, no `Content-Length` or `Transfer-Encoding`, one `Host` (required for HTTP/1.1), and none of the
headers a middleware around the route would act on. Whatever fails that (a bare LF, an obsolete line fold, a
control character, two Host headers) is the server's to answer, with its own 400 when it is one, so the
listener never answers 200 where the server would not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus

NEED_DATA = object()  # the start of what may be a probe: wait for more bytes
# A longer request is the server's (whose own limit, 16 KiB for h11 and 64 KiB for the gateway, then applies). Small
# enough that a socket's receive buffer always holds it: the listener only peeks, so a request larger than that
# buffer would wait for a window that never opens.
PROBE_MAX_BYTES = 8 << 10
_REQUEST_LINE = re.compile(rb"GET ([\x21-\x7e]+) HTTP/1\.([01])")
_HEADER_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*([\t\x20-\x7e\x80-\xff]*?)[ \t]*")
_HEAD_END = b"\r\n\r\n"
# Requests that a middleware outside the route would treat differently (CORS, 100-continue, websockets, the
# client address uvicorn's proxy-headers rewrite logs), and any request with a body: the server answers them.
SERVER_HEADERS = frozenset((b"origin", b"expect", b"upgrade", b"x-forwarded-for", b"content-length",
                            b"transfer-encoding"))
CLOSE_HEADER = (b"connection", b"close")
STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}


@dataclass(frozen=True)
class Probe:
    """A complete probe: its request line's parts, its headers (names lowercased), its length in bytes (what
    follows is the next request) and whether the connection stays open after the answer."""

    target: bytes
    http_version: bytes
    headers: list[tuple[bytes, bytes]]
    length: int
    keep_alive: bool


class ProbeParser:
    """`parse(data)` for the bytes a connection sent so far (peeked, not consumed)."""

    def __init__(self, paths):
        self.paths = frozenset(paths)
        self._prefixes = tuple(b"GET " + path for path in self.paths)

    def parse(self, data: bytes):
        """A `Probe`; NEED_DATA while `data` may still become one; None for anything the server must see."""
        if not (data.startswith(self._prefixes) or any(prefix.startswith(data) for prefix in self._prefixes)):
            return None
        end = data.find(_HEAD_END)
        # The lines complete so far: one the server's parser rejects as it comes (httptools parses as bytes
        # arrive) is the server's at once, not held here until the header timeout.
        head = data[:end] if end >= 0 else data[:max(data.rfind(b"\r\n"), 0)]
        if b"\n" in (data if end < 0 else head).replace(b"\r\n", b""):
            return None  # a bare LF, which the server's parser may take as a line end: it would not wait for CRLF
        request, headers = None, []
        if head:
            request_line, *lines = head.split(b"\r\n")
            request = _REQUEST_LINE.fullmatch(request_line)
            if request is None or request[1] not in self.paths:
                return None
            for line in lines:
                header = _HEADER_LINE.fullmatch(line)
                if header is None:
                    return None
                headers.append((header[1].lower(), header[2]))
        if end < 0:
            return None if len(data) > PROBE_MAX_BYTES else NEED_DATA
        names = [name for name, _ in headers]
        hosts = names.count(b"host")
        if any(name in SERVER_HEADERS for name in names) or hosts > 1 or (hosts == 0 and request[2] == b"1"):
            return None
        tokens = {token.strip().lower() for name, value in headers if name == b"connection" for token in value.split(b",")}
        return Probe(request[1], b"1." + request[2], headers, end + len(_HEAD_END),
                     keep_alive=request[2] == b"1" and b"close" not in tokens)


def response(status: int, headers: list[tuple[bytes, bytes]], body: bytes, probe: Probe) -> bytes:
    """The answer as uvicorn writes it: the status line, `headers` in order, `connection: close` when the
    connection closes after it (as uvicorn adds it for a request that asked), then the body."""
    lines = [STATUS_LINES[status]]
    lines.extend(name + b": " + value + b"\r\n" for name, value in headers)
    if not any(name.lower() == b"content-length" for name, _ in headers):
        lines.append(b"content-length: %d\r\n" % len(body))
    if not probe.keep_alive and CLOSE_HEADER not in headers:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines) + body
