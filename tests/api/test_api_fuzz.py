"""Schema-driven fuzzing: schemathesis generates requests from the server's own OpenAPI document
(valid and invalid ones, boundary values) and no response may be a 5xx. The issue's acceptance asks
for at least 5,000 generated requests; schema_fuzz.py says how 150 s reach that on two cores."""

import httpx
import pytest
from api_harness import Server
from schema_fuzz import run_fuzz

MIN_GENERATED = 5000
FUZZ_SECONDS = 150


@pytest.fixture(scope="module")
def fuzz_server():
    # random:tiny with a 64-token context: every accepted generation is short and cheap.
    server = Server("random:tiny", "--max-model-len", "64", "--num-gpu-blocks-override", "256", name="fuzz")
    yield server.wait_healthy()
    server.stop()


def test_schemathesis_finds_no_server_error(fuzz_server):
    generated, seconds, summary = run_fuzz(f"{fuzz_server.url}/openapi.json", seed=1, seconds=FUZZ_SECONDS)
    print(f"schema fuzz: {generated} generated requests against the engine in {seconds:.0f} s, no 5xx\n{summary}")
    assert generated >= MIN_GENERATED, summary
    assert fuzz_server.process.poll() is None
    served = httpx.post(f"{fuzz_server.url}/v1/completions", json={"model": "random:tiny", "prompt": [1], "max_tokens": 2},
                        timeout=30)
    assert served.status_code == 200, served.text
