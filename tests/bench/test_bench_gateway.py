"""`lockstep bench gateway` end to end, small: the fake engine, a real gateway, the clients, the report."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_gateway_reports_cpu_and_latency_for_each_target(tmp_path):
    # 12000 chunks and 1500 short streams: enough gateway CPU for figures even on a fast machine. At 42 us a chunk
    # (docs/BENCHMARKS.md) that is 50 clock ticks of /proc; 3000 chunks were 13, and a faster CI machine fell
    # under the 10 that a figure needs
    result_path = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "bench", "gateway", "--workers", "1", "--requests", "300",
         "--concurrency", "20", "--chunks", "40", "--chunk-interval-ms", "2", "--short-requests", "1500",
         "--json", str(result_path)],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {run["target"]: run for run in json.loads(result_path.read_text())["runs"]}
    assert set(runs) == {"direct", "gateway, 1 worker"}
    for run in runs.values():
        assert (run["streams"], run["chunks"], run["failed"]) == (300, 12000, 0)
        assert 0 < run["first_chunk_p50_ms"] <= run["first_chunk_p99_ms"]
        assert 0 <= run["chunk_delay_p50_ms"] <= run["chunk_delay_p99_ms"]
    gateway = runs["gateway, 1 worker"]
    figures = (gateway["cpu_us_per_chunk"], gateway["cpu_us_per_request"])
    assert all(figure is not None and figure > 0 for figure in figures), (figures, done.stderr[-3000:])
    assert runs["direct"]["cpu_us_per_chunk"] is None  # no gateway process to measure
    assert "| gateway, 1 worker |" in done.stdout  # the table
    assert "streams" in done.stderr  # progress lines


def test_bench_gateway_reports_no_figure_for_cpu_below_the_clock_tick_resolution(tmp_path):
    # A CI failure once: 20 short streams used under one clock tick, and the idle rate subtracted made it -6 us.
    result_path = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "bench", "gateway", "--workers", "1", "--no-direct", "--requests", "2",
         "--concurrency", "2", "--chunks", "2", "--chunk-interval-ms", "1", "--short-requests", "2",
         "--json", str(result_path)],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(result_path.read_text())["runs"]
    assert run["cpu_us_per_chunk"] is None and run["cpu_us_per_request"] is None
    assert "too little to measure per chunk (raise --requests or --chunks)" in done.stderr
    assert "too little to measure per request (raise --short-requests)" in done.stderr
