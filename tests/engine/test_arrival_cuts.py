"""Arrival cuts: a window the core is told to cut ends after the steps launched so far, the tokens are
those of uncut windows, and in the core process a request arriving mid-window cuts it and starts at
the next window (`--arrival-cuts`, on by default; `--no-arrival-cuts` runs every planned step)."""

import multiprocessing
import time

import pytest
import torch

from lockstep_common import metrics_names as n
from lockstep_engine import protocol as p
from lockstep_engine.config import EngineConfig
from lockstep_engine.core_process import run_engine_core
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request

STEPS = 16
CUT_AT_CALL = 3  # the cut answers True at its third question: steps 2 and 3 run, step 4 does not
PROMPTS = {"a": [5, 9, 13, 2, 7], "b": [11, 3, 3, 8, 1, 1], "late": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(core, cut_every: int | None, late_after_windows: int | None = None) -> tuple[dict, list[int]]:
    """Runs a, b (and `late`, added after that many windows) to the end; each request's tokens, and the
    steps each window ran. `cut_every`: should_cut says True at its cut_every-th question
    of each window (None: no should_cut)."""
    tokens: dict[str, list[int]] = {}
    windows = []

    def emit(step) -> None:
        for output in step.all_outputs():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)

    def add(request_id: str, max_tokens: int) -> None:
        core.add_request(Request(request_id, PROMPTS[request_id], _greedy(max_tokens), core.config.max_model_len, 0))

    add("a", 40)
    add("b", 29)
    for window in range(100):
        if not core.has_unfinished():
            break
        if window == late_after_windows:
            add("late", 12)
        asked = 0

        def should_cut() -> bool:
            nonlocal asked
            asked += 1
            return asked == cut_every

        timings = core.step(emit, should_cut if cut_every is not None else None)
        windows.append(timings.num_steps)
    assert not core.has_unfinished()
    return tokens, windows


@pytest.mark.parametrize("device", DEVICES)
def test_a_cut_window_ends_after_its_launched_steps_and_the_tokens_are_those_of_uncut_windows(device):
    llm = LLM("random:tiny", num_scheduler_steps=STEPS, num_gpu_blocks_override=128, device=device)
    core = llm.engine.core
    free = core.blocks.num_free_blocks
    uncut, uncut_windows = _run(core, None)
    assert core.stats.num_cut_windows == 0 and uncut_windows[:-1] == [STEPS] * (len(uncut_windows) - 1)
    cut, cut_windows = _run(core, CUT_AT_CALL, late_after_windows=2)
    # Every window but the last ran CUT_AT_CALL steps; the last may end sooner, its rows done (on the
    # CPU, where each step's tokens reach the host before the next is launched).
    assert cut_windows[:-1] == [CUT_AT_CALL] * (len(cut_windows) - 1) and cut_windows[-1] <= CUT_AT_CALL
    assert core.stats.num_cut_windows in (len(cut_windows) - 1, len(cut_windows))
    assert cut["a"] == uncut["a"] and cut["b"] == uncut["b"]
    assert len(cut["a"]) == 40 and len(cut["b"]) == 29
    assert cut["late"] == llm.generate([PROMPTS["late"]], _greedy(12))[0].outputs[0].token_ids
    assert core.blocks.num_free_blocks == free


@pytest.mark.parametrize("device", DEVICES)
def test_a_window_that_computes_part_of_a_prompt_ends_after_its_first_step(device):
    """A 40-token prompt under a 16-token budget takes three chunks, next to a decoding row: each window
    that leaves the prompt partly computed runs one step, so its chunks come a step apart, not a window."""
    llm = LLM("random:tiny", num_scheduler_steps=STEPS, num_gpu_blocks_override=128, max_num_batched_tokens=16,
              max_num_seqs=4, device=device)
    core = llm.engine.core
    tokens: dict[str, list[int]] = {}

    def emit(step) -> None:
        for output in step.all_outputs():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)

    core.add_request(Request("a", PROMPTS["a"], _greedy(60), core.config.max_model_len, 0))
    core.step(emit)  # a's prefill and first decode steps
    long_prompt = [(7 * i) % 1000 + 3 for i in range(40)]
    core.add_request(Request("long", long_prompt, _greedy(20), core.config.max_model_len, 0))
    windows = []
    while core.has_unfinished() and len(windows) < 100:
        before = len(tokens.get("a", []))
        windows.append((core.step(emit).num_steps, len(tokens.get("a", [])) - before, "long" in tokens))
    # Two windows with a chunk left after theirs ran one step (a decoded one token in each); the
    # window of the last chunk samples long's first token and runs its planned steps.
    assert [w[:2] for w in windows[:2]] == [(1, 1), (1, 1)] and not windows[1][2]
    assert windows[2][0] == STEPS and windows[2][2]
    assert core.stats.num_cut_windows == 2
    alone = llm.generate([PROMPTS["a"], long_prompt], [_greedy(60), _greedy(20)])
    assert [tokens["a"], tokens["long"]] == [out.outputs[0].token_ids for out in alone]


def _serve_long_then_late() -> tuple[dict[str, list[int]], float]:
    """A core process runs one long request in windows of 64 steps; `late` is sent once the long one's
    first tokens came. Each request's tokens, and the core's window-cut counter at the end."""
    ctx = multiprocessing.get_context("spawn")
    to_core_recv, to_core_send = ctx.Pipe(duplex=False)
    from_core_recv, from_core_send = ctx.Pipe(duplex=False)
    config = EngineConfig(model="random:tiny", skip_warmup=True, num_gpu_blocks_override=128, num_scheduler_steps=64,
                          device="cpu")
    process = ctx.Process(target=run_engine_core, args=(config, to_core_recv, from_core_send), daemon=True)
    process.start()
    to_core_recv.close()
    from_core_send.close()
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    cuts = 0.0

    columns = p.ColumnCache()

    def receive_until(done, timeout_s: float) -> None:
        nonlocal cuts
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            assert remaining > 0 and from_core_recv.poll(remaining), f"not reached within {timeout_s} s (cuts: {cuts})"
            message = from_core_recv.recv()
            assert not isinstance(message, (p.CoreFailed, p.RequestFailed)), message
            if isinstance(message, p.CoreReady):
                tokens["ready"] = []
            elif isinstance(message, p.StepOutputs):
                if message.batch is not None:  # a window's columns come with its first batch only
                    message.batch = columns.restore(message.batch)
                for output in message.all_outputs():
                    tokens.setdefault(output.request_id, []).extend(output.token_ids)
                    if output.finish_reason is not None:
                        finished.add(output.request_id)
            elif isinstance(message, p.CoreMetrics):
                cuts = message.counters.get(n.WINDOW_CUTS, {}).get((), 0.0)

    try:
        receive_until(lambda: "ready" in tokens, 120)
        to_core_send.send(p.AddRequest("long", PROMPTS["a"], _greedy(640).to_dict(), time.monotonic()))
        receive_until(lambda: "long" in tokens, 60)
        to_core_send.send(p.AddRequest("late", PROMPTS["late"], _greedy(12).to_dict(), time.monotonic()))
        receive_until(lambda: {"long", "late"} <= finished, 120)
        # The counters follow the outputs (at once when the core has nothing left to run).
        receive_until(lambda: cuts >= 1, 30)
        to_core_send.send(p.Shutdown())
        process.join(30)
    finally:
        if process.is_alive():
            process.kill()
    return tokens, cuts


def test_a_request_arriving_mid_window_cuts_it_in_the_core_process():
    tokens, cuts = _serve_long_then_late()
    assert cuts >= 1
    assert len(tokens["long"]) == 640
    # The reference runs where the core process ran (the CPU, float32), not where the `tiny` fixture
    # loads (CUDA and bfloat16 on a GPU machine): like is compared with like.
    reference = LLM("random:tiny", num_scheduler_steps=8, num_gpu_blocks_override=128, device="cpu")
    assert tokens["long"] == reference.generate([PROMPTS["a"]], _greedy(640))[0].outputs[0].token_ids
    assert tokens["late"] == reference.generate([PROMPTS["late"]], _greedy(12))[0].outputs[0].token_ids
