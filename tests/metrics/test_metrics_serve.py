"""Every metric `lockstep serve` exports moves under real traffic, to the value known where one is.

The server is `random:tiny` at N=8 on the CPU; requests send token ids (the model has no tokenizer).
Each test compares two scrapes of /metrics, so the order of tests does not matter, except for the
last one, which checks that nothing the earlier ones drove stayed at zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import httpx
import torch
from polling import wait_until

from lockstep_common import metrics_names as n
from lockstep_common import vllm_metrics as v

N = 8
SCRAPES: list = []  # every final scrape, for the sweep at the end


def _delta(before, after, name: str, **labels) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def _idle(server):
    return wait_until(lambda: server.scrape().get(v.NUM_REQUESTS_RUNNING) == 0 and server.scrape().get(v.NUM_REQUESTS_WAITING) == 0,
                      30, "an idle server")


def _settled(server, before, expect: dict[str, float], timeout_s: float = 30.0):
    """Polls /metrics until each named series grew by the expected amount (core snapshots arrive async)."""
    def check():
        after = server.scrape()
        return after if all(_delta(before, after, name) == value for name, value in expect.items()) else None

    try:
        after = wait_until(check, timeout_s, f"metrics deltas {expect}")
    except AssertionError:
        after = server.scrape()
        raise AssertionError({name: (_delta(before, after, name), value) for name, value in expect.items()}) from None
    SCRAPES.append(after)
    return after


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """A streamed completion with include_usage; returns the usage and the tokens seen per choice."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage, chunks = None, {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload["choices"]:
                chunks.setdefault(choice["index"], 0)
                chunks[choice["index"]] += 1
    return {"usage": usage, "choices": len(chunks)}


def test_token_counters_equal_the_usage_the_api_returned(server):
    _idle(server)
    before = server.scrape()
    bodies = [
        {"prompt": list(range(1, 6)), "max_tokens": 7, "ignore_eos": True},
        {"prompt": list(range(10, 47)), "max_tokens": 19, "ignore_eos": True},
        {"prompt": list(range(50, 53)), "max_tokens": 12, "ignore_eos": True, "n": 2, "temperature": 1.0},
        {"prompt": list(range(60, 160)), "max_tokens": 3, "ignore_eos": True},
    ]
    streamed = [{"prompt": list(range(200, 221)), "max_tokens": 25, "ignore_eos": True},
                {"prompt": [7, 8], "max_tokens": 9, "ignore_eos": True}]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            plain = [client.post(f"{server.url}/v1/completions", json={"model": server.model, **b}) for b in bodies]
            streams = [_stream(client, server.url, {"model": server.model, **b}) for b in streamed]
            results = await asyncio.gather(*plain, *streams)
        answers = []
        for result in results[:len(bodies)]:
            assert result.status_code == 200, result.text
            answers.append({"usage": result.json()["usage"], "choices": len(result.json()["choices"])})
        return answers + list(results[len(bodies):])

    answers = asyncio.run(run())
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    choices = sum(a["choices"] for a in answers)
    requests = len(answers)
    after = _settled(server, before, {n.PROMPT_TOKENS: prompt, n.GENERATION_TOKENS: completion,
                                      f"{n.QUEUE_TIME}_count": requests})
    assert _delta(before, after, f"{n.REQUEST_PROMPT_TOKENS}_sum") == prompt
    assert _delta(before, after, f"{n.REQUEST_GENERATION_TOKENS}_sum") == completion
    assert _delta(before, after, f"{n.REQUEST_PROMPT_TOKENS}_count") == requests
    assert _delta(before, after, f"{n.TTFT}_count") == requests
    assert _delta(before, after, f"{n.E2E_LATENCY}_count") == requests
    # One token per step message: every token but each sample's first is one ITL observation.
    assert _delta(before, after, f"{n.ITL}_count") == completion - choices
    assert _delta(before, after, n.REQUESTS_FINISHED, reason="length") == choices
    assert after.get(f"{n.TTFT}_sum") > before.get(f"{n.TTFT}_sum")
    assert after.get("lockstep_api_stream_delay_seconds_count") > before.get("lockstep_api_stream_delay_seconds_count")


def test_window_length_histogram_counts_windows_of_n(server):
    """One request of 5*N tokens alone: 5 windows of N steps, the first after idle without a boundary gap."""
    _idle(server)
    before = server.scrape()
    answer = server.complete(prompt=list(range(300, 311)), max_tokens=5 * N, ignore_eos=True)
    assert answer["usage"]["completion_tokens"] == 5 * N
    after = _settled(server, before, {f"{n.WINDOW_STEPS}_count": 5})

    def window(le: str) -> float:
        return _delta(before, after, f"{n.WINDOW_STEPS}_bucket", le=le)

    assert window(str(float(N))) - window(str(float(N - 1))) == 5
    assert _delta(before, after, f"{n.WINDOW_STEPS}_sum") == 5 * N
    assert _delta(before, after, n.STEPS, boundary="window_start") == 5
    assert _delta(before, after, n.STEPS, phase="prefill") == 1
    assert _delta(before, after, n.STEPS, boundary="intra") == 5 * (N - 1)
    assert _delta(before, after, f"{n.STEP_GAP}_count", boundary="intra") == 5 * (N - 1)
    assert _delta(before, after, f"{n.STEP_GAP}_count", boundary="window_start") == 4
    assert _delta(before, after, f"{n.STEP_DURATION}_count") == 5 * N
    assert _delta(before, after, f"{n.STEP_TOKENS}_sum", phase="prefill") == 11
    assert _delta(before, after, f"{n.STEP_TOKENS}_count", phase="decode") == 5 * N - 1
    assert _delta(before, after, f"{n.STEP_TOKENS}_sum", phase="decode") == 5 * N - 1
    busy = _delta(before, after, n.GPU_BUSY)
    idle = _delta(before, after, n.GPU_IDLE)
    assert busy > 0 and idle > 0
    assert abs(busy - _delta(before, after, f"{n.STEP_DURATION}_sum")) < 1e-9
    assert abs(idle - _delta(before, after, f"{n.STEP_GAP}_sum")) < 1e-9
    for phase in ("schedule", "prepare", "pythonize", "update"):
        assert _delta(before, after, f"{n.HOST_PHASE}_count", phase=phase) == 5, phase
    for phase in ("detokenize", "output_ipc"):
        assert _delta(before, after, f"{n.HOST_PHASE}_count", phase=phase) == 5 * N, phase
    assert _delta(before, after, n.WASTED_TOKENS) == 0


def _greedy_tokens(server, prompt: list[int], count: int) -> list[int]:
    answer = server.complete(prompt=prompt, max_tokens=count, ignore_eos=True, temperature=0, logprobs=0)
    return [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]]


def test_wasted_tokens_when_a_stop_lands_mid_window(server):
    """B stops at its second token while A keeps the window going: the other N-2 steps of B are wasted."""
    prompt = [5, 6, 7]
    tokens = _greedy_tokens(server, prompt, 16)
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    _idle(server)
    before = server.scrape()
    first_chunk = threading.Event()
    done = threading.Event()

    def long_request():
        body = {"model": server.model, "prompt": [9, 9, 9, 9], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
        done.set()

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    assert first_chunk.wait(30)
    answer = server.complete(prompt=prompt, max_tokens=16, ignore_eos=True, temperature=0, stop_token_ids=[tokens[k]])
    assert answer["choices"][0]["finish_reason"] == "stop", (answer, tokens, k)
    assert answer["usage"]["completion_tokens"] == k + 1
    assert done.wait(60)
    # Its window's other N-(k+1) steps at least. Under overlap the next window may be planned before the
    # stop is seen on the host (on a GPU, when the stop lands in the steps left on the device): the row then
    # runs that window too, as a sink row whose steps are wasted as well, never more than one window.
    lower = N - (k + 1)

    def settled():  # both answered, and the core's snapshot from after its last window (nothing running)
        scrape = server.scrape()
        done_ = _delta(before, scrape, n.REQUESTS_FINISHED) == 2 and scrape.get(v.NUM_REQUESTS_RUNNING) == 0
        return scrape if done_ and _delta(before, scrape, n.WASTED_TOKENS) >= lower else None

    after = wait_until(settled, 30, f"at least {lower} wasted tokens and an idle engine")
    SCRAPES.append(after)
    wasted = _delta(before, after, n.WASTED_TOKENS)
    assert wasted <= lower + N, (wasted, k)
    assert _delta(before, after, n.REQUESTS_FINISHED, reason="stop") == 1


def test_prefix_cache_queries_and_hits_count_tokens(server):
    """The same 40-token prompt twice: each looks up 39 tokens; the second finds the 2 full blocks."""
    _idle(server)
    before = server.scrape()
    # Token ids above 900: no other test's prompt (the Prometheus load uses 1..900) starts like this one.
    prompt = list(range(901, 941))
    for _ in range(2):
        server.complete(prompt=prompt, max_tokens=2 * N, ignore_eos=True)
    _settled(server, before, {n.PREFIX_CACHE_QUERIES: 78, n.PREFIX_CACHE_HITS: 32})


def test_scheduler_gauges_and_abort_follow_a_request_in_flight(server):
    _idle(server)
    before = server.scrape()
    body = {"model": server.model, "prompt": list(range(500, 540)), "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()  # held open: a dropped iterator closes the stream (an abort)
        next(line for line in lines if line.startswith("data: {"))
        during = wait_until(lambda: (s := server.scrape()).get(v.NUM_REQUESTS_RUNNING) == 1 and s, 30, "one running request")
        assert during.get(n.REQUESTS_RUNNING) == 1
        usage = during.get(v.KV_CACHE_USAGE)
        assert 0 < usage <= 1 and during.get(n.KV_CACHE_USAGE) == usage
        SCRAPES.append(during)
    after = _settled(server, before, {n.REQUESTS_FINISHED: 1})
    assert _delta(before, after, n.REQUESTS_FINISHED, reason="abort") == 1
    wait_until(lambda: server.scrape().get(v.NUM_REQUESTS_RUNNING) == 0, 30, "the aborted request to leave the batch")
    assert server.scrape().get(v.KV_CACHE_USAGE) == 0


def test_cache_config_and_step_timer_info(server):
    scrape = server.scrape()
    assert scrape.get(v.CACHE_CONFIG_INFO, block_size=16, num_gpu_blocks=1024, num_scheduler_steps=N,
                      model_name=server.model) == 1
    # the server runs where `lockstep serve` puts it by default: on a CUDA device where there is one
    timer = "cuda_events" if torch.cuda.is_available() else "host_clock"
    other = "host_clock" if timer == "cuda_events" else "cuda_events"
    assert scrape.get(n.STEP_TIMER_INFO, method=timer) == 1
    assert scrape.get(n.STEP_TIMER_INFO, method=other) == 0


def test_preemptions_and_waiting_on_a_small_kv_cache(small_cache_server):
    """2 seats, 12 blocks of 16 tokens, 4 requests of 20 + 80 tokens (7 blocks each): 2 wait, 1 is preempted."""
    server = small_cache_server
    before = server.scrape()
    waiting_seen = []

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(client.post(f"{server.url}/v1/completions", json={
                "model": server.model, "prompt": list(range(i * 20, i * 20 + 20)), "max_tokens": 80,
                "ignore_eos": True})) for i in range(4)]
            while not all(t.done() for t in tasks):
                scrape = await asyncio.to_thread(server.scrape)
                waiting_seen.append(scrape.get(v.NUM_REQUESTS_WAITING))
                if scrape.get(v.NUM_REQUESTS_WAITING) > 0:
                    assert scrape.get(n.REQUESTS_WAITING) == scrape.get(v.NUM_REQUESTS_WAITING)
                    SCRAPES.append(scrape)
                await asyncio.sleep(0.02)
            return [t.result().json()["usage"] for t in tasks]

    usages = asyncio.run(run())
    assert all(u["completion_tokens"] == 80 for u in usages)
    assert max(waiting_seen) > 0, waiting_seen
    after = _settled(server, before, {n.GENERATION_TOKENS: 320})
    assert _delta(before, after, n.PREEMPTIONS) > 0


def test_engine_core_loss_fails_requests_in_flight_and_exits(small_cache_server):
    """Fatal means exit: a request in flight when the core dies ends with an error event for
    its client, and the server exits non-zero (no window to scrape the error counter is promised)."""
    server = small_cache_server
    SCRAPES.append(server.scrape())  # the last scrape of this server, for the sweep at the end
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        os.kill(server.core_pid(), signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    events = [json.loads(line[6:]) for line in rest[:-1]]
    errors = [event["error"] for event in events if "error" in event]
    assert len(errors) == 1 and errors[0]["code"] == 503 and "engine core failed" in errors[0]["message"], errors
    assert "error" in events[-1], "the error event is the stream's last"
    assert server.process.wait(30) == 1, server.log_tail()
    assert "the engine core died" in server.log_tail(200)


def test_every_exported_counter_and_histogram_moved():
    """Runs last: across the scrapes above, no counter or histogram the engine exports stayed at zero."""
    assert SCRAPES, "run the whole module"
    families = {}
    for line in SCRAPES[-1].text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            families[name] = kind
    # Speculative decoding's counters move only on a server started with --speculative-config, which this
    # module's server is not (tests/api/test_api_speculative.py asserts that they move there).
    speculative = {name.removesuffix("_total") for name, _, _ in n.SPEC_DECODE_SERIES}
    speculative |= {v.SPEC_DECODE_NUM_DRAFTS, v.SPEC_DECODE_NUM_DRAFT_TOKENS, v.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
                    v.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS}
    still = []
    for name, kind in families.items():
        sample = f"{name}_count" if kind == "histogram" else name
        if kind == "gauge" or name.removesuffix("_total") in speculative:
            continue  # the gauges have their own tests above (they return to 0 when idle)
        if not any(scrape.get(sample) > 0 for scrape in SCRAPES):
            still.append(name)
    assert not still, f"never moved: {still}"
    assert {n.STEP_GAP, n.GPU_IDLE, n.PREEMPTIONS, n.WASTED_TOKENS} <= set(families)
