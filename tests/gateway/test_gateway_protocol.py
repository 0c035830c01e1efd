"""Requests that are not HTTP the gateway can parse get the OpenAI error shape too, not uvicorn's plain text."""

from __future__ import annotations

import json
import socket

import pytest


def exchange(port: int, data: bytes) -> bytes:
    """Sends `data` on a new connection and reads until the gateway closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def last_error(answer: bytes) -> tuple[int, dict]:
    """The status and JSON body of the last response in `answer`."""
    head, _, body = answer.rpartition(b"HTTP/1.1 ")[2].partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 1)[0]), json.loads(body)["error"]


@pytest.fixture(scope="module")
def gateway(log_dir):
    from gateway_harness import gateway_starter

    with gateway_starter(log_dir) as start:
        yield start("--engine=http://127.0.0.1:9")  # nothing listens there: these requests never reach one


def test_a_garbage_request_line_gets_an_openai_400(gateway):
    status, error = last_error(exchange(gateway.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert "not valid HTTP/1.1" in error["message"]


def test_bytes_past_the_content_length_get_an_openai_400(gateway):
    body = b'{"model": "random:tiny", "prompt": "hello", "max_tokens": 2}'
    answer = exchange(gateway.port, b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json"
                                    b"\r\ncontent-length: 10\r\n\r\n" + body)
    status, error = last_error(answer)
    assert status == 400 and "Content-Length" in error["message"]


def test_headers_over_the_limit_get_an_openai_431(gateway):
    status, error = last_error(exchange(gateway.port, b"GET /health HTTP/1.1\r\nhost: gateway\r\nx-padding: "
                                                      + b"a" * (100 << 10) + b"\r\n\r\n"))
    assert status == 431 and error["code"] == 431 and "65536 bytes" in error["message"]
