"""The health listener's probe parser (lockstep_common/probe_http.py): a plain `GET /health` is a probe; whatever a
server's own parser might answer differently is left to the server (None), never answered here."""

from __future__ import annotations

import pytest
from lockstep_common.probe_http import NEED_DATA, PROBE_MAX_BYTES, Probe, ProbeParser, response

PARSER = ProbeParser([b"/health", b"/ping"])


def test_a_plain_probe_is_answered_and_its_length_excludes_what_follows():
    data = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: abc\r\n\r\nGET /version HTTP/1.1\r\n"
    probe = PARSER.parse(data)
    assert isinstance(probe, Probe)
    assert (probe.target, probe.http_version, probe.keep_alive) == (b"/health", b"1.1", True)
    assert probe.headers == [(b"host", b"x"), (b"x-request-id", b"abc")]
    assert data[probe.length:] == b"GET /version HTTP/1.1\r\n"


@pytest.mark.parametrize("data", [b"G", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: x\r\n"])
def test_the_start_of_a_probe_waits_for_more(data):
    assert PARSER.parse(data) is NEED_DATA


@pytest.mark.parametrize(("data", "keep_alive"), [
    (b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Close\r\n\r\n", False),
    (b"GET /health HTTP/1.0\r\n\r\n", False),  # HTTP/1.0: no Host needed, the connection closes
    (b"GET /health HTTP/1.1\r\nhost:x  \r\n\r\n", True),  # optional whitespace around the value
])
def test_connection_close_and_http_1_0(data, keep_alive):
    assert PARSER.parse(data).keep_alive is keep_alive


@pytest.mark.parametrize("data", [
    b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health?api_key=k HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # no Host: h11's 400
    b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"GET /health HTTP/1.1\nHost: x\n\n",  # bare LF
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n",  # obsolete line folding
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A : 1\r\n\r\n",  # space before the colon
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",  # a control character
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://a\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * PROBE_MAX_BYTES,  # never ends within the limit
    b"POST /v1/completions HTTP/1.1\r\n",
    # Incomplete, but a line already complete is not a probe's: the server answers it at once (httptools does).
    b"GET /health\r\n",
    b"GET /health HTTP/1.1\r\nNot a header\r\nHost: x",
    b"GET /health HTTP/1.1\nHost",
])
def test_anything_else_goes_to_the_server(data):
    assert PARSER.parse(data) is None


def test_the_answer_is_written_as_uvicorn_writes_it():
    probe = PARSER.parse(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    headers = [(b"server", b"uvicorn"), (b"content-type", b"application/json")]
    assert response(503, headers, b'{"a":1}', probe) == (
        b"HTTP/1.1 503 Service Unavailable\r\nserver: uvicorn\r\ncontent-type: application/json\r\n"
        b"content-length: 7\r\nconnection: close\r\n\r\n{\"a\":1}")
    kept = PARSER.parse(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert response(200, [(b"content-length", b"0")], b"", kept) == b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
