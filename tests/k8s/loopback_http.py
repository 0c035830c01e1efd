"""Loopback HTTP servers for the tests of the in-pod scripts (model fetcher, LoRA sync): a threaded
http.server on 127.0.0.1 at a free port, and the gzip tarballs the scripts unpack."""

from __future__ import annotations

import http.server
import io
import tarfile
import threading
from collections.abc import Callable

# handle(path, headers) -> (status, response headers, body)
Handle = Callable[[str, object], tuple[int, dict, bytes]]


class LoopbackHTTP:
    """Serves `handler_class` on 127.0.0.1 (port chosen by the kernel) in a daemon thread until close()."""

    def start(self, handler_class: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # noqa: ANN002 - http.server's signature
        pass


class RecordingServer(LoopbackHTTP):
    """Answers GETs with `handle` and records every request (path, Authorization header)."""

    def __init__(self, handle: Handle) -> None:
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(QuietHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.requests.append((self.path, self.headers.get("Authorization")))
                status, headers, body = handle(self.path, self.headers)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.start(Handler)


def static_files(files: dict[str, tuple[str, bytes]]) -> Handle:
    """A handle serving path -> (content type, body); any other path is a 404."""
    def handle(path: str, headers: object) -> tuple[int, dict, bytes]:
        if path not in files:
            return 404, {"Content-Type": "text/plain"}, b""
        content_type, body = files[path]
        return 200, {"Content-Type": content_type}, body
    return handle


def tarball(members: dict[str, bytes]) -> bytes:
    """A gzip tar archive of name -> bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
