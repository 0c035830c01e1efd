"""Warm-up before ready: `/health` is 503 while the engine core warms up and 200 after, and the first
request of a warmed-up server gets what a server without warm-up (`--skip-warmup`) gives it."""

import os
import signal

import httpx

from api_harness import START_TIMEOUT_S, Server
from polling import wait_until

ARGS = ("--num-gpu-blocks-override", "512", "--max-num-seqs", "32", "--max-model-len", "512")
STARTED, DONE = "[lockstep] warm-up: compiling", "[lockstep] warm-up: done"


def _log(server: Server) -> str:
    with open(server.log_path, "rb") as handle:
        return handle.read().decode(errors="replace")


def _first_requests(server: Server) -> list:
    client = server.client()
    outputs = []
    for body in ({"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.8, "n": 2}):
        response = client.completions.create(model="random:tiny", prompt=list(range(3, 40)), max_tokens=12,
                                             logprobs=0, extra_body={"ignore_eos": True}, **body)  # no seed: drawn
        outputs.append([(c.logprobs.tokens, c.logprobs.token_logprobs) for c in response.choices])
    return outputs


WARM_UP_TRIES = 3  # a warm-up that ends before the test can freeze it is started again, this many times


def _frozen_in_warm_up(server: Server) -> bool:
    """Waits for the core's warm-up to start and freezes the core there (SIGSTOP); False when the
    warm-up ended before the freeze took hold (the core is running then)."""
    wait_until(lambda: STARTED in _log(server) or server.process.poll() is not None, START_TIMEOUT_S,
               interval_s=0.005, what="the warm-up's start")
    assert server.process.poll() is None, server.log_tail()
    pid = server.core_pid()
    os.kill(pid, signal.SIGSTOP)
    if DONE not in _log(server):
        return True
    os.kill(pid, signal.SIGCONT)
    return False


def test_health_is_503_during_warm_up_and_the_first_requests_match_a_server_without_it():
    cold = Server("random:tiny", *ARGS, "--skip-warmup", name="cold")
    servers = [cold]
    try:
        # The core is frozen inside its warm-up while /health is asked: its answer cannot race the
        # warm-up's end, however fast the warm-up or slow the machine.
        for _ in range(WARM_UP_TRIES):
            warm = Server("random:tiny", *ARGS, name="warm")
            servers.append(warm)
            if _frozen_in_warm_up(warm):
                break
            warm.stop()
        else:
            raise AssertionError(f"the warm-up ended before it could be frozen, {WARM_UP_TRIES} times")
        try:
            assert httpx.get(f"{warm.url}/health", timeout=30.0).status_code == 503
        finally:
            os.kill(warm.core_pid(), signal.SIGCONT)
        assert DONE not in _log(warm)
        warm.wait_healthy()
        # The core reports ready only after its warm-up ended.
        assert DONE in _log(warm) and "[lockstep] start-up: " in _log(warm)
        cold.wait_healthy()
        assert STARTED not in _log(cold) and "warm-up skipped" in _log(cold)
        # Nothing of the warm-up is left in the counters, the KV cache or the prefix cache.
        for name in ("lockstep_prompt_tokens_total", "lockstep_generation_tokens_total", "lockstep_steps_total",
                     "lockstep_prefix_cache_queries_total", "vllm:kv_cache_usage_perc", "lockstep_gpu_busy_seconds_total"):
            assert warm.metric(name) == 0, name
        assert _first_requests(warm) == _first_requests(cold)
    finally:
        for server in servers:
            server.stop()
