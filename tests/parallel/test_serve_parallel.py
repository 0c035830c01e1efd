"""`lockstep serve` with TP and PP: the same tokens through the API, and a lost rank is a 503."""

import os
import signal
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "api"))
from api_harness import Server  # noqa: E402

ARGS = ("--num-gpu-blocks-override", "128", "--max-model-len", "512", "--device", "cpu")
PROMPTS = [[(31 * i + 7 * k) % 1000 + 3 for k in range(5 + 9 * i)] for i in range(4)]


def _tokens(server: Server) -> list[list[str]]:
    client = server.client()
    result = client.completions.create(model="random:tiny", prompt=PROMPTS, max_tokens=16, temperature=0,
                                       logprobs=1, extra_body={"ignore_eos": True})
    return [choice.logprobs.tokens for choice in sorted(result.choices, key=lambda c: c.index)]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return [int(x) for x in handle.read().split()]


@pytest.fixture(scope="module")
def single():
    server = Server("random:tiny", *ARGS, "--num-scheduler-steps", "8", name="single").wait_healthy()
    yield server
    server.stop()


def test_tp2_and_pp2_through_the_api_match_one_process(single):
    expected = _tokens(single)
    assert all(len(t) == 16 for t in expected)
    for layout in (("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2")):
        server = Server("random:tiny", *ARGS, *layout, name="-".join(layout)).wait_healthy()
        try:
            assert _tokens(server) == expected, layout
        finally:
            server.stop()


def test_killed_worker_turns_health_503_and_a_new_group_serves(single):
    server = Server("random:tiny", *ARGS, "--tensor-parallel-size", "2", name="tp2-kill").wait_healthy()
    try:
        workers = _children(server.core_pid())
        assert workers, "the engine core should have spawned a worker rank"
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        status = 200
        while time.monotonic() < deadline and status == 200:
            status = httpx.get(f"{server.url}/health", timeout=2).status_code
            if status == 200:
                time.sleep(0.2)  # polling /health with a deadline
        assert status == 503
    finally:
        server.stop()
    again = Server("random:tiny", *ARGS, "--tensor-parallel-size", "2", name="tp2-again").wait_healthy()
    try:
        assert _tokens(again) == _tokens(single)
    finally:
        again.stop()
