"""The HTTP/1.1 front door (lockstep_common/header_limits.py) on every protocol that wears it: the engine's httptools
protocol (its default where httptools is installed) and h11 protocol, and the gateway's httptools protocol answer
the same, on a real uvicorn server each."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn

from lockstep_common.header_limits import MAX_HEADER_BYTES
from lockstep_engine.api.http_limits import header_timeout_protocol as engine_protocol
from lockstep_gateway.main import header_timeout_protocol as gateway_protocol

HEADER_TIMEOUT_S = 1.0


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = json.dumps({"received": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                        (b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@contextlib.contextmanager
def _server(protocol):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, http=protocol, log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module", params=["engine-httptools", "engine-h11", "gateway"])
def port(request):
    if request.param == "gateway":
        protocol = gateway_protocol(HEADER_TIMEOUT_S)
    else:
        protocol = engine_protocol(HEADER_TIMEOUT_S, request.param.removeprefix("engine-"))
    with _server(protocol) as port:
        yield port


def test_the_engine_takes_httptools_when_it_is_installed_and_refuses_an_unknown_parser():
    assert engine_protocol(HEADER_TIMEOUT_S).__name__ == "HeaderTimeoutHttptoolsProtocol"
    assert engine_protocol(HEADER_TIMEOUT_S, "h11").__name__ == "HeaderTimeoutH11Protocol"
    with pytest.raises(ValueError, match="parser: 'spdy' is not one of auto, httptools, h11"):
        engine_protocol(HEADER_TIMEOUT_S, "spdy")


def _exchange(port: int, *chunks: bytes) -> tuple[int, bytes]:
    """Sends the chunks on a new connection, reads until it closes: (status of the last response, its body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    head, _, body = answer.rpartition(b"HTTP/1.1 ")[2].partition(b"\r\n\r\n")
    return int(head.split(b" ", 1)[0]), body


def _request(headers: bytes = b"", body: bytes = b"") -> bytes:
    return (b"POST /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\ncontent-length: %d\r\n" % len(body)) + headers \
        + b"\r\n" + body


def test_headers_over_the_limit_get_an_openai_431_whole_or_in_pieces(port):
    padding = b"x-padding: " + b"a" * (MAX_HEADER_BYTES + 1024) + b"\r\n"
    whole = _request(padding)
    for chunks in ([whole], [whole[:1000], whole[1000:40000], whole[40000:]]):
        status, body = _exchange(port, *chunks)
        error = json.loads(body)["error"]
        assert status == 431 and error["code"] == 431 and f"{MAX_HEADER_BYTES} bytes" in error["message"]


def test_a_large_body_behind_small_headers_is_no_431(port):
    status, body = _exchange(port, _request(body=b"b" * (80 << 10)))
    assert status == 200 and json.loads(body) == {"received": 80 << 10}


def test_a_request_that_is_not_http_gets_an_openai_400(port):
    status, body = _exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
    error = json.loads(body)["error"]
    assert status == 400 and error["type"] == "BadRequestError" and "not valid HTTP/1.1" in error["message"]


def test_headers_that_never_finish_close_the_connection_after_the_timeout(port):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\nx-slow: ")
        assert sock.recv(65536) == b""  # closed, with no answer
        assert HEADER_TIMEOUT_S - 0.1 <= time.monotonic() - started < HEADER_TIMEOUT_S + 5
