"""`lockstep bench health` end to end, small: the fake engine, a real gateway, a burst of streams, the prober."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_health_reports_probe_latency_during_a_burst(tmp_path):
    result_path = tmp_path / "health.json"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "bench", "health", "--streams", "50", "--chunks", "5",
         "--chunk-interval-ms", "50", "--probe-interval-ms", "100", "--json", str(result_path)],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert (result["streams"], result["streams_failed"], result["probes_failed"]) == (50, 0, 0)
    assert result["probes"] >= 20  # 1 s before the burst and 1 s after it, every 100 ms
    assert 0 < result["probe_p50_ms"] <= result["probe_p99_ms"] <= result["probe_max_ms"]
    assert json.loads(done.stdout) == result
