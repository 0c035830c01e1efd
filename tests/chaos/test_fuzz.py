"""A bounded schema fuzz run: schemathesis generates requests from the gateway's /openapi.json (the
engines' request schemas) and sends them through the gateway to a real engine; no answer may be a
5xx, and the engine serves afterwards. At least 5,000 generated requests (the issue's acceptance);
tests/api/schema_fuzz.py says how 150 s reach that on two cores."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
from gateway_harness import MODEL, Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
from hostile_bodies import send_all
from hostile_constraints import send_all as send_constraints
from schema_fuzz import run_fuzz

MIN_GENERATED = 5000
FUZZ_SECONDS = 150


def test_schema_fuzz_through_the_gateway_gets_no_5xx(log_dir, start_gateway):
    engine = Engine("fuzz-engine", log_dir)
    engine.argv += ["--max-model-len", "64"]  # generated max_tokens stay cheap
    engine.start()
    try:
        engine.wait_healthy()
        gateway = start_gateway(f"--engine={engine.url}", expect_healthy={engine.url})
        generated, seconds, summary = run_fuzz(gateway.url + "/openapi.json", seed=15, seconds=FUZZ_SECONDS)
        print(f"schema fuzz: {generated} generated requests through the gateway in {seconds:.0f} s\n{summary}")
        assert generated >= MIN_GENERATED, summary
        hostile = send_all(gateway.url, MODEL)  # raw invalid UTF-8, wrong-typed tool fields: 400s, via the gateway
        assert [(name, status) for name, status, error, _ in hostile if status != 400 or error is None] == []
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        server_errors = [line for line in metrics.splitlines()
                         if line.startswith("lockstep_gateway_requests_total") and 'status="5' in line]
        assert not server_errors, server_errors
        served = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2},
                            timeout=30)
        assert served.status_code == 200
    finally:
        engine.stop()


def test_hostile_constraints_and_large_bodies_through_the_gateway_get_4xx_beside_a_stream(log_dir, start_gateway):
    """The constraints that crashed an engine (a `$ref` chain of 2500, a grammar of 10,000 chained rules) and
    the rest of hostile_constraints.py, then bodies whose sizes alone refuse them (2,000,000 token ids, a
    1,000,000-item list), through the gateway to a SmolLM2 engine (structured outputs need its tokenizer):
    never a 5xx, both processes alive, and a stream beside them reaches its end."""
    engine = Engine("hostile-engine", log_dir)
    engine.argv[engine.argv.index(MODEL)] = "smollm2"
    engine.argv += ["--max-model-len", "256", "--num-scheduler-steps", "1", "--skip-warmup"]
    engine.start()
    try:
        engine.wait_healthy()
        gateway = start_gateway(f"--engine={engine.url}", expect_healthy={engine.url})
        with httpx.stream("POST", gateway.url + "/v1/completions", timeout=300, json={
                "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            answers = send_constraints(gateway.url, "smollm2", seed=2)
            assert [(name, status) for name, status, _, _ in answers if status not in (200, 400)] == []
            chains = {name: error for name, status, error, _ in answers if name.startswith("$ref chain of ")
                      and status == 400}
            assert {"$ref chain of 2500", "$ref chain of 10000"} <= set(chains), answers
            assert all(error["param"] == "response_format" for error in chains.values()), chains
            for fields, param in (({"prompt": [1000 + i % 30_000 for i in range(2_000_000)]}, "prompt"),
                                  ({"prompt": [1], "stop": ["x"] * 1_000_000}, "stop")):
                refused = httpx.post(gateway.url + "/v1/completions", timeout=120,
                                     json={"model": "smollm2", "max_tokens": 1, **fields})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
            rest = [line for line in lines if line.startswith("data: {")]
        assert '"finish_reason":"length"' in rest[-1].replace(" ", ""), rest[-1]
        assert engine.alive() and gateway.alive()
    finally:
        engine.stop()
