"""Schema-driven fuzzing: schemathesis generates requests from the server's own OpenAPI document
(valid and invalid ones, boundary values) and no response may be a 5xx."""

import shutil
import subprocess
import sys

import pytest

FUZZ_SECONDS = 150  # schemathesis stops at this or at MAX_EXAMPLES per operation, whichever comes first
MAX_EXAMPLES = 450  # x ~12 operations: up to about 5,000 generated requests


def test_schemathesis_finds_no_server_error(smol1, tmp_path):
    # smol1 has a 128-token context, so every accepted generation is short.
    command = [shutil.which("schemathesis") or "schemathesis", "run", f"{smol1.url}/openapi.json",
               "--checks", "not_a_server_error", "--phases", "coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
               "--max-time", str(FUZZ_SECONDS), "--seed", "1", "--workers", "1", "--request-timeout", "60",
               "--no-color"]
    if shutil.which("schemathesis") is None:
        pytest.fail(f"schemathesis is not installed for {sys.executable} (pip install -e .[dev])")
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_SECONDS + 180)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
    print(result.stdout[-1500:])  # the summary: test cases generated and responses seen
