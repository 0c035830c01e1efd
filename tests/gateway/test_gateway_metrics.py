"""Every gateway metric moves when its event happens (fake engines: no model to load)."""

from __future__ import annotations

import threading

import httpx
from gateway_harness import MODEL, FakeEngine, wait_for


def test_request_latency_health_ejection_and_in_flight_metrics_move(start_gateway):
    with FakeEngine([MODEL], behaviour="ok") as steady, FakeEngine([MODEL], behaviour="hang") as stuck:
        gateway = start_gateway(f"--engine={steady.url}", expect_healthy={steady.url})
        body = {"model": MODEL, "prompt": [1], "stream": True}
        assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=10).status_code == 200
        assert httpx.post(gateway.url + "/v1/completions", json={"model": "nope"}, timeout=10).status_code == 404
        assert gateway.metric("lockstep_gateway_requests_total", route="completions", model=MODEL, status="200") == 1
        assert gateway.metric("lockstep_gateway_requests_total", route="completions", model="unknown",
                              status="404") == 1
        assert gateway.metric("lockstep_gateway_upstream_latency_seconds_count", route="completions",
                              phase="first_byte") == 1
        # observed when the relay finishes, just after the client read the last chunk
        wait_for("the stream's total latency", lambda: gateway.metric(
            "lockstep_gateway_upstream_latency_seconds_count", route="completions", phase="total") == 1, timeout=10)
        assert gateway.metric("lockstep_gateway_upstream_healthy", engine=steady.url) == 1

        held = start_gateway(f"--engine={stuck.url}", expect_healthy={stuck.url})
        answers: list[int] = []
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(held.url + "/v1/completions", json={"model": MODEL, "prompt": [1]}, timeout=30).status_code))
        client.start()
        wait_for("one request open upstream",
                 lambda: held.metric("lockstep_gateway_upstream_in_flight", engine=stuck.url) == 1, timeout=10)
        stuck.release.set()  # the fake hangs up without an answer after taking the request: not replayed
        client.join(timeout=30)
        assert answers == [502]
        assert held.metric("lockstep_gateway_upstream_in_flight", engine=stuck.url) == 0
        assert held.metric("lockstep_gateway_upstream_requests_total", engine=stuck.url, outcome="error") == 1
    gateway.wait_engines(set())
    assert gateway.metric("lockstep_gateway_ejections_total", engine=steady.url) == 1
    assert gateway.metric("lockstep_gateway_upstream_healthy", engine=steady.url) == 0


def test_metrics_carry_engine_ids_not_urls(start_gateway):
    """/metrics needs no key: its engine label is an id; /gateway/engines (the key's side) maps it to the URL."""
    with FakeEngine([MODEL], behaviour="ok") as engine:
        gateway = start_gateway(f"--engine={engine.url}", expect_healthy={engine.url})
        assert httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                          timeout=10).status_code == 200
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
        listed = gateway.engines()[engine.url]
        assert f'engine="{listed["id"]}"' in text and engine.url not in text
        port = engine.url.rsplit(":", 1)[1]
        assert f":{port}" not in text
