"""`lockstep serve` with TP and PP: the same tokens through the API, and a lost rank ends the server."""

import os
import signal
import subprocess
import sys

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


def test_killed_worker_makes_the_server_exit_and_a_new_group_serves(single):
    """A lost rank is fatal for the group: the engine core fails, and `lockstep serve` exits non-zero
    (so that its supervisor restarts it) instead of answering 503 forever."""
    server = Server("random:tiny", *ARGS, "--tensor-parallel-size", "2", name="tp2-kill").wait_healthy()
    try:
        workers = _children(server.core_pid())
        assert workers, "the engine core should have spawned a worker rank"
        os.kill(workers[0], signal.SIGKILL)
        try:
            code = server.process.wait(timeout=60)  # 10 s on an idle machine; this one may be loaded
        except subprocess.TimeoutExpired:
            raise AssertionError(f"lockstep serve still running 60 s after its worker died:\n{server.log_tail()}") \
                from None
        assert code != 0, server.log_tail()
    finally:
        server.stop()
    again = Server("random:tiny", *ARGS, "--tensor-parallel-size", "2", name="tp2-again").wait_healthy()
    try:
        assert _tokens(again) == _tokens(single)
    finally:
        again.stop()
