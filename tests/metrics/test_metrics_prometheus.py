"""A real Prometheus scrapes a real `lockstep serve`; PromQL agrees with what the test measured itself.

Prometheus (the Debian package) runs on 127.0.0.1 with a generated config scraping every 250 ms: the
engine server, and the operator's metrics registry served the way the operator serves it (no cluster
here, so no reconciles: its series exist at zero). The shipped Grafana dashboard's every query must
return data from it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import sys
import time

import httpx
import pytest
from metrics_harness import REPO, Process, Prometheus, free_port
from polling import wait_until

from lockstep_common import metrics_names as n
from lockstep_common import vllm_metrics as v

DASHBOARD = os.path.join(REPO, "charts", "lockstep", "dashboards", "lockstep.json")
LOAD_S = 6.0
WORKERS = 3


@pytest.fixture(scope="module")
def operator_metrics(log_dir):
    """The operator's REGISTRY on an HTTP port, exactly as `lockstep_operator.main.run` serves it."""
    port = free_port()
    code = ("import signal; from prometheus_client import disable_created_metrics, start_http_server; "
            "from lockstep_operator.metrics import REGISTRY; disable_created_metrics(); "
            f"start_http_server({port}, addr='127.0.0.1', registry=REGISTRY); signal.pause()")
    process = Process("operator-metrics", [sys.executable, "-c", code], log_dir)
    try:
        process.wait_http(f"http://127.0.0.1:{port}/metrics", timeout_s=60)
        yield f"127.0.0.1:{port}"
    finally:
        process.stop()


@pytest.fixture(scope="module")
def prometheus(server, operator_metrics, log_dir):
    started = Prometheus(log_dir, {"lockstep-engine": f"127.0.0.1:{server.port}",
                                   "lockstep-operator": operator_metrics})
    try:
        started.wait_http(f"{started.url}/-/ready", timeout_s=60)
        wait_until(lambda: started.targets_up(2), 30, "both targets up")
        yield started
    finally:
        started.stop()


async def _worker(client: httpx.AsyncClient, url: str, model: str, seed: int, until: float, out: list) -> None:
    i = 0
    while time.monotonic() < until:
        body = {"model": model, "prompt": [(seed * 31 + i * 7 + k) % 900 + 1 for k in range(16)], "max_tokens": 24,
                "ignore_eos": True, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
        started = time.monotonic()
        ttft, usage = None, None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if ttft is None and any((c.get("logprobs") or {}).get("tokens") for c in payload["choices"]):
                    ttft = time.monotonic() - started
                usage = payload.get("usage") or usage
        out.append((ttft, usage["completion_tokens"]))
        i += 1


@pytest.fixture(scope="module")
def traffic(server, prometheus):
    """LOAD_S seconds of streamed requests from WORKERS clients; what the client saw, and when."""
    wait_until(lambda: server.scrape().get(v.NUM_REQUESTS_RUNNING) == 0, 30, "an idle server")
    # Prometheus must hold an idle sample before the load starts.
    before = server.scrape()
    wait_until(lambda: prometheus.query(f"{n.GENERATION_TOKENS} >= {before.get(n.GENERATION_TOKENS)}"), 10,
               "a scrape before the load")
    results: list = []

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            until = time.monotonic() + LOAD_S
            workers = [_worker(client, server.url, server.model, w, until, results) for w in range(WORKERS)]
            await asyncio.gather(*workers)

    t0, m0 = time.time(), time.monotonic()
    asyncio.run(run())
    t1, m1 = time.time(), time.monotonic()
    tokens = sum(count for _, count in results)
    after = wait_until(lambda: (s := server.scrape()).get(n.GENERATION_TOKENS) == before.get(n.GENERATION_TOKENS)
                       + tokens and s.get(f"{n.WINDOW_STEPS}_count") > before.get(f"{n.WINDOW_STEPS}_count")
                       and server.scrape(), 30, "the server's counters to settle")
    settled = after.get(n.GENERATION_TOKENS)
    wait_until(lambda: prometheus.query(f"{n.GENERATION_TOKENS} == {settled}"), 10, "Prometheus to scrape the end")
    return {"t0": t0, "t1": t1, "seconds": m1 - m0, "tokens": tokens, "ttfts": [t for t, _ in results],
            "before": before, "after": after, "requests": len(results)}


def _range(seconds: float) -> str:
    return f"{math.ceil(seconds * 1000)}ms"


def test_promql_tokens_per_second_agrees_with_the_client(prometheus, traffic):
    client_rate = traffic["tokens"] / traffic["seconds"]
    window = _range(traffic["t1"] - traffic["t0"])
    rate = prometheus.scalar(f"sum(rate({n.GENERATION_TOKENS}[{window}]))", at=traffic["t1"])
    assert rate == pytest.approx(client_rate, rel=0.15), (rate, client_rate)
    total = prometheus.scalar(f"sum(increase({n.GENERATION_TOKENS}[{_range(time.time() - traffic['t0'] + 1)}]))")
    assert total == pytest.approx(traffic["tokens"], rel=0.1)


def test_promql_p50_ttft_agrees_with_the_client(prometheus, traffic):
    ttfts = [t for t in traffic["ttfts"] if t is not None]
    assert len(ttfts) == traffic["requests"] >= WORKERS
    client_p50 = statistics.median(ttfts)
    window = _range(time.time() - traffic["t0"] + 1)
    p50 = prometheus.scalar(f"histogram_quantile(0.5, sum by (le) (rate({n.TTFT}_bucket[{window}])))")
    # A histogram quantile is exact to its bucket: the server's lies in the client's bucket or, as the
    # server's clock stops before the HTTP response is written, in the one below.
    bounds = (0.0, *n.TTFT_BUCKETS)
    index = next(i for i in range(1, len(bounds)) if client_p50 <= bounds[i])
    assert bounds[max(index - 2, 0)] <= p50 <= bounds[index], (p50, client_p50, bounds[index - 1:index + 1])


def test_promql_idle_fraction_agrees_with_the_engine_counters(prometheus, traffic):
    before, after = traffic["before"], traffic["after"]
    idle = after.get(n.GPU_IDLE) - before.get(n.GPU_IDLE)
    busy = after.get(n.GPU_BUSY) - before.get(n.GPU_BUSY)
    measured = idle / (idle + busy)
    assert 0 < measured < 1
    window = _range(time.time() - traffic["t0"] + 1)
    fraction = prometheus.scalar(f"sum(rate({n.GPU_IDLE}[{window}])) / (sum(rate({n.GPU_IDLE}[{window}])) + "
                                 f"sum(rate({n.GPU_BUSY}[{window}])))")
    assert fraction == pytest.approx(measured, abs=0.03), (fraction, measured)


def _panels(panels):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def test_every_dashboard_query_returns_data(prometheus, traffic):
    with open(DASHBOARD) as handle:
        dashboard = json.load(handle)
    window = _range(time.time() - traffic["t0"] + 5)
    checked = 0
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            query = (expr.replace("$namespace", ".*").replace("$llmservice", ".*")
                     .replace("$__rate_interval", window))
            result = prometheus.query(query)
            assert result, f"panel {panel['title']!r}: no data for {query}"
            if "lockstep_operator_" not in expr:  # the operator here has reconciled nothing
                values = [float(r["value"][1]) for r in result]
                assert any(math.isfinite(v) for v in values), f"panel {panel['title']!r}: {query} -> {values}"
            checked += 1
    assert checked >= 15
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric = variable["query"].split("(", 1)[1].split("{", 1)[0].split(",", 1)[0].strip()
            assert prometheus.query(metric), f"variable {variable['name']}: no {metric}"
