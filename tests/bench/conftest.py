"""A real, small OpenAI-compatible HTTP server for the benchmark client to load.

It streams `/v1/completions` as SSE over HTTP/1.1 chunked encoding, with known token counts
and known delays, and misbehaves on request for prompts starting with a marker token id.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

MODEL_ID = "fake-model"


@dataclass
class FakeServerOptions:
    first_token_delay_s: float = 0.0
    inter_chunk_delay_s: float = 0.0
    tokens_per_chunk: int = 1
    send_usage: bool = True
    required_api_key: str | None = None


@dataclass
class FakeServer:
    # A prompt whose first token id is one of these gets the matching misbehaviour (tests read them
    # from the fixture's server object: importing from a conftest is ambiguous across test folders).
    MODEL_ID: ClassVar[str] = MODEL_ID
    HTTP_500_TOKEN: ClassVar[int] = 7
    IN_STREAM_ERROR_TOKEN: ClassVar[int] = 8
    STALL_TOKEN: ClassVar[int] = 9

    url: str
    options: FakeServerOptions
    payloads: list[dict] = field(default_factory=list)
    max_in_flight: int = 0
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # set at teardown so stalled handlers return at once
    release: threading.Event = field(default_factory=threading.Event)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_state: FakeServer  # set on a per-server subclass

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def _authorized(self) -> bool:
        key = self.server_state.options.required_api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self._send_json(
            401, {"error": {"message": "bad key", "type": "AuthenticationError", "param": None, "code": 401}}
        )
        return False

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_event(self, body: dict | str) -> None:
        self._send_chunk(f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n")

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self._send_json(
                404, {"error": {"message": "not found", "type": "NotFoundError", "param": None, "code": 404}}
            )
            return
        if self._authorized():
            self._send_json(200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "test"}]})

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server_state
        with state.lock:
            state.payloads.append(payload)
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            if self._authorized():
                self._complete(payload)
        finally:
            with state.lock:
                state.in_flight -= 1

    def _complete(self, payload: dict) -> None:
        state, options = self.server_state, self.server_state.options
        marker = payload["prompt"][0]
        if marker == state.HTTP_500_TOKEN:
            self._send_json(
                500,
                {"error": {"message": "injected failure", "type": "InternalServerError", "param": None, "code": 500}},
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if marker == state.STALL_TOKEN:
            state.release.wait(timeout=10)
            return
        self._send_chunk(": keep-alive comment\n\n")
        time.sleep(options.first_token_delay_s)
        if marker == state.IN_STREAM_ERROR_TOKEN:
            self._send_event(
                {"error": {"message": "engine died", "type": "InternalServerError", "param": None, "code": 500}}
            )
        else:
            self._stream_tokens(payload)
        self._send_event("[DONE]")
        self._send_chunk("")  # the zero-length chunk ends the body

    def _stream_tokens(self, payload: dict) -> None:
        options = self.server_state.options
        num_tokens = payload["max_tokens"]
        for first in range(0, num_tokens, options.tokens_per_chunk):
            if first:
                time.sleep(options.inter_chunk_delay_s)
            count = min(options.tokens_per_chunk, num_tokens - first)
            finish = "length" if first + count == num_tokens else None
            choice = {"index": 0, "text": " tok" * count, "logprobs": None, "finish_reason": finish}
            self._send_event({"id": "cmpl-1", "object": "text_completion", "model": MODEL_ID, "choices": [choice]})
        if options.send_usage and payload.get("stream_options", {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(payload["prompt"]),
                "completion_tokens": num_tokens,
                "total_tokens": len(payload["prompt"]) + num_tokens,
            }
            self._send_event(
                {"id": "cmpl-1", "object": "text_completion", "model": MODEL_ID, "choices": [], "usage": usage}
            )


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver listens with a backlog of 5; a benchmark opens all its connections at once, and on a loaded
    # machine the accept thread falls behind them
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        # A client closing its connection (a timed-out request, the pool shutting down) is expected.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """Start fake servers on 127.0.0.1 ephemeral ports: `fake_server(**FakeServerOptions fields)`."""
    started: list[tuple[_QuietServer, FakeServer, threading.Thread]] = []

    def start(**options: object) -> FakeServer:
        state = FakeServer(url="", options=FakeServerOptions(**options))
        handler = type("Handler", (_Handler,), {"server_state": state})
        httpd = _QuietServer(("127.0.0.1", 0), handler)
        state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        thread.start()
        started.append((httpd, state, thread))
        return state

    yield start
    for httpd, state, thread in started:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
