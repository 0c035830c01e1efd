"""Warm-up before ready: `/health` is 503 while the engine core warms up and 200 after, and the first
request of a warmed-up server gets what a server without warm-up (`--skip-warmup`) gives it."""

import httpx

from api_harness import START_TIMEOUT_S, Server, wait_until

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


def test_health_is_503_during_warm_up_and_the_first_requests_match_a_server_without_it():
    warm, cold = Server("random:tiny", *ARGS, name="warm"), Server("random:tiny", *ARGS, "--skip-warmup", name="cold")
    try:
        seen_503_in_warm_up = False

        def healthy() -> bool:
            nonlocal seen_503_in_warm_up
            before = _log(warm)
            try:
                status = httpx.get(f"{warm.url}/health", timeout=5.0).status_code
            except httpx.HTTPError:
                return False
            after = _log(warm)
            if status == 200:
                # The core reports ready only after its warm-up ended.
                assert DONE in after, after[-2000:]
                return True
            # Warm-up had started before the request and had not ended after the answer.
            seen_503_in_warm_up |= status == 503 and STARTED in before and DONE not in after
            assert warm.process.poll() is None, warm.log_tail()
            return False

        wait_until(healthy, START_TIMEOUT_S, interval_s=0.02, what="the warmed-up server's /health 200")
        assert seen_503_in_warm_up
        assert "[lockstep] start-up: " in _log(warm)
        cold.wait_healthy()
        assert STARTED not in _log(cold) and "warm-up skipped" in _log(cold)
        # Nothing of the warm-up is left in the counters, the KV cache or the prefix cache.
        for name in ("lockstep_prompt_tokens_total", "lockstep_generation_tokens_total", "lockstep_steps_total",
                     "lockstep_prefix_cache_queries_total", "vllm:kv_cache_usage_perc", "lockstep_gpu_busy_seconds_total"):
            assert warm.metric(name) == 0, name
        assert _first_requests(warm) == _first_requests(cold)
    finally:
        warm.stop()
        cold.stop()
