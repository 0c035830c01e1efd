"""A bounded schema fuzz run: schemathesis generates requests from the gateway's /openapi.json (the
engines' request schemas) and sends them through the gateway to a real engine; no answer may be a
5xx, and the engine serves afterwards. docs/RELIABILITY.md gives the size of the run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gateway_harness import MODEL, Engine

EXAMPLES_PER_OPERATION = 400  # about 1,200 requests (hypothesis drops duplicates): ~2.5 minutes here
FUZZ_TIMEOUT_S = 400


def _schemathesis() -> list[str]:
    cli = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if cli is None:
        pytest.skip("schemathesis (the dev extra) is not installed")
    return [cli]


def test_schema_fuzz_through_the_gateway_gets_no_5xx(log_dir, start_gateway, tmp_path):
    command = _schemathesis()
    engine = Engine("fuzz-engine", log_dir)
    engine.argv += ["--max-model-len", "64"]  # generated max_tokens stay cheap
    engine.start()
    try:
        engine.wait_healthy()
        gateway = start_gateway(f"--engine={engine.url}", expect_healthy={engine.url})
        result = subprocess.run(
            [*command, "run", gateway.url + "/openapi.json", "--checks", "not_a_server_error", "--phases", "fuzzing",
             "-n", str(EXAMPLES_PER_OPERATION), "-w", "2", "--request-timeout", "30", "--seed", "15", "--warnings", "off"],
            capture_output=True, text=True, timeout=FUZZ_TIMEOUT_S, check=False, cwd=tmp_path)  # its cache dir
        assert result.returncode == 0, result.stdout[-4000:]
        generated = int(re.search(r"(\d+) generated", result.stdout).group(1))
        assert generated >= 1000, result.stdout[-2000:]
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        server_errors = [line for line in metrics.splitlines()
                         if line.startswith("lockstep_gateway_requests_total") and 'status="5' in line]
        assert not server_errors, server_errors
        served = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2},
                            timeout=30)
        assert served.status_code == 200
        print(f"schema fuzz: {generated} generated requests through the gateway, no 5xx")
    finally:
        engine.stop()
