"""`--routing kv-cache` through a real gateway: the engine with more free KV cache takes the requests even
with more requests running (least-load, over the same engines, sends them to the other); session affinity
still sticks a key to one engine of two real engines."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from gateway_harness import MODEL, wait_for
from lockstep_common import vllm_metrics as v


class GaugedEngine:
    """Answers like an engine with fixed load gauges: /health, /v1/models, /metrics, and a completion per POST."""

    def __init__(self, running: int, kv_cache_usage: float):
        self.num_posts = 0
        gauges = (f'{v.NUM_REQUESTS_RUNNING}{{model_name="{MODEL}"}} {running}\n'
                  f'{v.NUM_REQUESTS_WAITING}{{model_name="{MODEL}"}} 0\n'
                  f'{v.KV_CACHE_USAGE}{{model_name="{MODEL}"}} {kv_cache_usage}\n').encode()
        completion = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                 "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                answers = {"/health": b"{}", "/v1/models": models, "/metrics": gauges}
                self._send(answers.get(self.path, b"{}"), "text/plain" if self.path == "/metrics" else "application/json")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                fake.num_posts += 1
                self._send(completion)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def roomy_and_full() -> Iterator[tuple[GaugedEngine, GaugedEngine]]:
    roomy, full = GaugedEngine(running=6, kv_cache_usage=0.2), GaugedEngine(running=0, kv_cache_usage=0.9)
    try:
        yield roomy, full
    finally:
        roomy.close()
        full.close()


def _served_by(gateway, engines, requests: int) -> list[int]:
    def scraped():
        return all(gateway.engines()[e.url]["load"] for e in engines)

    wait_for("the gateway to scrape both engines", scraped)
    before = [e.num_posts for e in engines]
    for _ in range(requests):
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
        assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).status_code == 200
    return [e.num_posts - b for e, b in zip(engines, before)]


@pytest.mark.parametrize(("routing", "expected"), [("kv-cache", [8, 0]), ("least-load", [0, 8])])
def test_kv_cache_sends_requests_to_free_cache_where_least_load_sends_them_to_fewer_requests(
        roomy_and_full, start_gateway, routing, expected):
    engines = list(roomy_and_full)
    gateway = start_gateway(*[f"--engine={e.url}" for e in engines], f"--routing={routing}",
                            expect_healthy={e.url for e in engines})
    assert _served_by(gateway, engines, 8) == expected


def test_kv_cache_keeps_a_session_on_one_of_two_real_engines(engines, start_gateway):
    gateway = start_gateway(*[f"--engine={e.url}" for e in engines], "--routing=kv-cache",
                            expect_healthy={e.url for e in engines})

    def counts() -> list[float]:
        return [gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok") for e in engines]

    for session in ("session-1", "session-2", "session-3"):
        before = counts()
        for _ in range(5):
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
            response = httpx.post(gateway.url + "/v1/completions", json=body, headers={"x-session-id": session},
                                  timeout=60)
            assert response.status_code == 200, response.text
        moved = [after - b for after, b in zip(counts(), before)]
        assert sorted(moved) == [0, 5], (session, moved)
