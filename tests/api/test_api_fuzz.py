"""Schema-driven fuzzing: schemathesis generates requests from the server's own OpenAPI document
(valid and invalid ones, boundary values) and no response may be a 5xx. The issue's acceptance asks
for at least 5,000 generated requests; schema_fuzz.py says how 150 s reach that on two cores."""

import json

import httpx
import pytest
from api_harness import Server
from hostile_bodies import send_all
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


def test_raw_invalid_utf8_and_wrong_typed_tool_fields_get_400s_naming_the_field(fuzz_server):
    answers = send_all(fuzz_server.url, "random:tiny")
    wrong = [(name, status, error) for name, status, error, _ in answers
             if status != 400 or error is None or error.get("code") != 400]
    assert not wrong, wrong
    misnamed = [(name, error["param"], param) for name, _, error, param in answers
                if param is not None and error["param"] != param]
    assert not misnamed, misnamed
    assert all(b"\xed" not in json.dumps(error).encode() for _, _, error, _ in answers)  # nothing echoed raw
