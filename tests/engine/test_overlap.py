"""Overlap (`async_scheduling`): a window's last step is handed over while the next window runs, and
the next window starts from that step's tokens on the device. The tokens must be exactly those of
windows that hand every step over themselves, whatever happens at the boundary: finishes, admissions,
arrival cuts, aborts, stop strings, preemption, prefix hits, forks. On the CPU the runner holds the
last step back so the same code paths run (the CPU default is off)."""

import random
import time

import pytest
import torch

from lockstep_engine.engine_core import CoreStats
from lockstep_engine.llm import LLM
from lockstep_engine import metrics as metrics_module
from lockstep_engine.metrics import CoreMetrics
from lockstep_engine.runner.cuda_graphs import DecodeGraphs
from lockstep_engine.runner import model_runner
from lockstep_engine.runner.host_stream import HostRing, StepStream, WindowTail
from lockstep_engine.runner.outputs import StepTag, StepTiming, WindowTimings
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request

STEPS = (1, 4, 8)
# On CUDA the tail's copy lands asynchronously and decode-only windows run as graph replays; "cpu-cuda-paths"
# runs those paths on the CPU (graphs replayed eagerly on their static buffers, copies into a host ring whose
# events have always landed). float32 everywhere: overlap moves preemptions (a row that finishes in a pending
# step holds its blocks one window longer), and a recomputed prompt must give the same tokens.
DEVICES = ["cpu", "cpu-cuda-paths"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def tiny_base(request) -> LLM:
    llm = LLM("random:tiny", num_scheduler_steps=8, num_gpu_blocks_override=256, max_num_seqs=16,
              async_scheduling=False, device=request.param.removesuffix("-cuda-paths"), dtype="float32")
    llm.cuda_paths = request.param == "cpu-cuda-paths"
    return llm


def _use_cuda_paths(llm: LLM) -> None:
    runner = llm.engine.core.executor.runner
    runner.graphs = DecodeGraphs(runner.steps, capture=False)
    runner.host_ring = HostRing(allocate=lambda numel, dtype: torch.empty(numel, dtype=dtype),
                                event_factory=_LandedEvent)


def _tiny(base: LLM, overlap: bool, **kwargs) -> LLM:
    settings = {"num_scheduler_steps": 8, "num_gpu_blocks_override": 256, "max_num_seqs": 16, **kwargs}
    llm = LLM("random:tiny", share_model_with=base, async_scheduling=overlap, device=base.engine.config.device,
              dtype="float32", **settings)
    if base.cuda_paths:  # a new engine over the shared runner resets its graphs
        _use_cuda_paths(llm)
    return llm


def _workload(seed: int, count: int = 40) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 60))] for _ in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40), ignore_eos=i % 3 != 0)
              for i in range(count)]
    return prompts, params


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[choice.token_ids for choice in out.outputs] for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("num_steps", STEPS)
def test_overlap_gives_the_tokens_of_windows_that_hand_every_step_over(tiny_base, num_steps):
    prompts, params = _workload(num_steps)
    expected = _tokens(_tiny(tiny_base, False, num_scheduler_steps=num_steps), prompts, params)
    llm = _tiny(tiny_base, True, num_scheduler_steps=num_steps)
    assert _tokens(llm, prompts, params) == expected
    stats = llm.engine.core.stats
    assert stats.num_overlapped_windows == stats.num_windows > 0
    assert llm.engine.core.blocks.num_free_blocks == llm.engine.core.blocks.num_blocks


@pytest.mark.parametrize("tail_steps", (1, 2, 3))
def test_a_deeper_tail_gives_the_same_tokens_and_frees_every_block(tiny_base, tail_steps, monkeypatch):
    """Windows leave their last 1-3 steps to the next: rows that end in them (max_tokens or eos) run there
    as done rows, and the tokens equal those of windows that hand every step over."""
    depths = []

    class RecordedTail(WindowTail):
        def __init__(self, *args):
            super().__init__(*args)
            depths.append(self.depth)

    monkeypatch.setattr(model_runner, "TAIL_STEPS", tail_steps)
    monkeypatch.setattr(model_runner, "WindowTail", RecordedTail)
    prompts, params = _workload(tail_steps + 10, count=48)
    expected = _tokens(_tiny(tiny_base, False), prompts, params)
    llm = _tiny(tiny_base, True, enable_prefix_caching=True)
    assert _tokens(llm, prompts, params) == expected
    assert max(depths) == tail_steps and min(depths) >= 1
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    # A block enters the prefix cache only with all its tokens known on the host (none still pending)
    cached = [block for block in blocks._blocks if block.block_hash is not None]
    assert cached and all(len(block.token_ids) == blocks.block_size for block in cached)


def test_overlap_off_hands_every_step_over(tiny_base):
    llm = _tiny(tiny_base, False)
    _tokens(llm, *_workload(1, count=4))
    assert llm.engine.core.stats.num_overlapped_windows == 0 and llm.engine.core.stats.num_windows > 0


def test_preemption_under_overlap(tiny_base):
    """A cache of 20 blocks for 16 rows of up to 100 tokens: running rows are preempted (some of them
    carried from a window whose last step is still pending) and recomputed."""
    prompts, params = _workload(7)
    expected = _tokens(_tiny(tiny_base, False), prompts, params)
    llm = _tiny(tiny_base, True, num_gpu_blocks_override=20)
    assert _tokens(llm, prompts, params) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_prefix_hits_under_overlap(tiny_base):
    rng = random.Random(3)
    shared = [rng.randrange(1, 250) for _ in range(48)]
    prompts = [shared + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 9))] for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True) for _ in prompts]
    expected = _tokens(_tiny(tiny_base, False), prompts, params)
    llm = _tiny(tiny_base, True)
    assert _tokens(llm, prompts, params) == expected
    assert llm.engine.core.blocks.prefix_cache_hits > 0


def test_forks_logprobs_and_seeded_sampling_under_overlap(tiny_base):
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=21, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=17, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True)]
    off = _tiny(tiny_base, False).generate(prompts, params)
    on = _tiny(tiny_base, True).generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in on] == [[c.token_ids for c in o.outputs] for o in off]
    assert [(e.token_id, round(e.logprob, 4)) for e in on[1].outputs[0].logprobs] == \
        [(e.token_id, round(e.logprob, 4)) for e in off[1].outputs[0].logprobs]


def test_a_row_that_needs_its_tokens_on_the_host_makes_its_windows_synchronous(tiny_base):
    """Penalties count a row's earlier tokens on the host: windows with such a row hand every step over."""
    prompts = [[5, 9, 13, 2, 7]]
    params = [SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True)]
    expected = _tokens(_tiny(tiny_base, False), prompts, params)
    llm = _tiny(tiny_base, True)
    assert _tokens(llm, prompts, params) == expected
    assert llm.engine.core.stats.num_overlapped_windows == 0 and llm.engine.core.stats.num_windows > 0


def _run_core(core, requests: dict[str, tuple[list[int], int]], late: dict[str, tuple[list[int], int]] | None = None,
              cut_at: int | None = None, abort: tuple[str, int] | None = None) -> dict[str, list[int]]:
    """Drives `core.step` to the end: `late` requests arrive after two windows, `cut_at` makes should_cut
    answer True at that question of each window, `abort` = (request id, window) aborts it before that window."""
    tokens: dict[str, list[int]] = {}

    def emit(step) -> None:
        for output in step.all_outputs():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)

    def add(batch) -> None:
        for request_id, (prompt, max_tokens) in batch.items():
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            core.add_request(Request(request_id, prompt, params, core.config.max_model_len, 0))

    add(requests)
    for window in range(200):
        if not core.has_unfinished():
            break
        if window == 2 and late:
            add(late)
        if abort is not None and window == abort[1]:
            for output in core.abort_request(abort[0]):
                tokens.setdefault(output.request_id, []).extend(output.token_ids)
        asked = 0

        def should_cut() -> bool:
            nonlocal asked
            asked += 1
            return asked == cut_at

        core.step(emit, should_cut if cut_at is not None else None)
    assert not core.has_unfinished()
    return tokens


REQUESTS = {"a": ([5, 9, 13, 2, 7], 40), "b": ([11, 3, 3, 8, 1, 1], 29), "c": ([4] * 20, 3)}
LATE = {"late": ([1, 2, 3, 4, 5, 6, 7, 8, 9], 12)}


@pytest.mark.parametrize("cut_at", (None, 1, 3))
def test_arrival_cuts_under_overlap(tiny_base, cut_at):
    expected = _run_core(_tiny(tiny_base, False).engine.core, REQUESTS, LATE, cut_at)
    core = _tiny(tiny_base, True).engine.core
    assert _run_core(core, REQUESTS, LATE, cut_at) == expected
    assert core.stats.num_overlapped_windows > 0 and core.blocks.num_free_blocks == core.blocks.num_blocks
    if cut_at is not None:
        assert core.stats.num_cut_windows > 0


@pytest.mark.parametrize("window", (1, 2, 3))
def test_an_abort_while_a_tail_is_pending_ends_that_request_alone(tiny_base, window):
    expected = _run_core(_tiny(tiny_base, False).engine.core, REQUESTS)
    core = _tiny(tiny_base, True).engine.core
    got = _run_core(core, REQUESTS, abort=("a", window))
    assert got["b"] == expected["b"] and got["c"] == expected["c"]
    assert got["a"] == expected["a"][:len(got["a"])] and len(got["a"]) < len(expected["a"])
    assert core.blocks.num_free_blocks == core.blocks.num_blocks and not core.requests


def _cached_blocks(core) -> set[tuple[int, ...]]:
    return {block.token_ids for block in core.blocks._blocks if block.block_hash is not None}


@pytest.mark.parametrize("tail_steps", (1, 2, 3))
@pytest.mark.parametrize("abort_at", (None, 2, 3))
def test_blocks_filled_under_overlap_enter_the_prefix_cache_as_without_it(tiny_base, abort_at, tail_steps,
                                                                          monkeypatch):
    """Under overlap a window's filled blocks are hashed after the next window is launched, not on the
    way to launching it. Every full block of tokens computed and on the host still enters the prefix
    cache, an aborted request's and one that ended in a pending step included, and without an abort the
    cache ends as the synchronous one: no block whose last slot was never fed (e's 32 tokens end a block)."""
    monkeypatch.setattr(model_runner, "TAIL_STEPS", tail_steps)
    rng = random.Random(5)
    requests = {name: ([rng.randrange(1, 250) for _ in range(length)], max_tokens)
                for name, length, max_tokens in (("a", 37, 45), ("b", 16, 33), ("c", 50, 3), ("d", 5, 60),
                                                 ("e", 16, 16))}
    size = tiny_base.engine.core.blocks.block_size
    sync_core = _tiny(tiny_base, False, enable_prefix_caching=True).engine.core
    _run_core(sync_core, requests)
    core = _tiny(tiny_base, True, enable_prefix_caching=True).engine.core
    got = _run_core(core, requests, abort=None if abort_at is None else ("a", abort_at))
    cached = _cached_blocks(core)
    for name, (prompt, _) in requests.items():
        computed = (prompt + got[name])[:-1]  # the last token sampled was never fed back
        full = [tuple(computed[i:i + size]) for i in range(0, len(computed) - size + 1, size)]
        assert full and set(full) <= cached, name
    if abort_at is None:
        assert cached == _cached_blocks(sync_core)
    else:
        assert len(got["a"]) < requests["a"][1]
    assert not core._unhashed and core.blocks.num_free_blocks == core.blocks.num_blocks


@pytest.fixture(scope="module")
def smollm2_pair(make_llm):
    return make_llm(num_scheduler_steps=8, async_scheduling=False), make_llm(num_scheduler_steps=8,
                                                                             async_scheduling=True)


def test_stop_strings_and_eos_under_overlap(smollm2_pair):
    off, on = smollm2_pair
    prompts = ["Once upon a time, in a land far away,", "The capital of France is", "1, 2, 3, 4,"]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[" the"]),
              SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=30, stop=["8"], include_stop_str_in_output=True)]
    expected = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in off.generate(prompts, params)]
    got = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in on.generate(prompts, params)]
    assert got == expected
    assert any(reason == "stop" for _, _, reason in got)
    assert on.engine.core.stats.num_overlapped_windows > 0


def test_occupancy_is_busy_over_busy_and_idle_of_recent_forwards(monkeypatch):
    metrics = CoreMetrics()
    assert metrics.occupancy == 0.0
    timings = WindowTimings(num_steps=3, steps=[
        StepTiming(StepTag(1, "decode", 4), forward_s=0.009, gap_s=None),  # after idle: no gap counted
        StepTiming(StepTag(2, "decode", 4), forward_s=0.009, gap_s=0.001),
        StepTiming(StepTag(1, "decode", 4), forward_s=0.010, gap_s=0.001)])
    metrics.record_window(CoreStats(num_windows=1, num_steps=3, num_overlapped_windows=1), timings)
    assert metrics.occupancy == pytest.approx(0.028 / 0.030)
    # Forwards older than the gauge's span drop out of it; later ones count alone.
    later = time.monotonic() + metrics_module.OCCUPANCY_WINDOW_S + 1
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: later)
    assert metrics.occupancy == 0.0
    metrics.record_window(CoreStats(num_windows=2, num_steps=4, num_overlapped_windows=2), WindowTimings(
        num_steps=1, steps=[StepTiming(StepTag(1, "decode", 4), forward_s=0.002, gap_s=0.002)]))
    assert metrics.occupancy == pytest.approx(0.5)


class _LandedEvent:
    """A copy that has always landed by the time it is asked about (a fast device, a small batch)."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("hold", (0, 1, 2))
@pytest.mark.parametrize("landed", (True, False), ids=("async", "sync"))
def test_a_held_stream_keeps_its_newest_steps_even_when_their_copies_landed(hold, landed):
    delivered = []
    ring = HostRing(allocate=lambda numel, dtype: torch.empty(numel, dtype=dtype), event_factory=_LandedEvent)
    stream = StepStream(lambda out: delivered.append(out.step), WindowTimings(), ring if landed else None, hold=hold)
    for step in (1, 2, 3, 4):
        stream.push(step, torch.tensor([[7, 8], [0, 0]]), None, sync=not landed)
    assert delivered == [1, 2, 3, 4][:4 - hold] and stream.undelivered == hold
    stream.drain(keep=1)
    assert delivered == [1, 2, 3, 4][:4 - min(hold, 1)] and stream.undelivered == min(hold, 1)
    stream.drain()
    assert delivered == [1, 2, 3, 4] and stream.undelivered == 0
