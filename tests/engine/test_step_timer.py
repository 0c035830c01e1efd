"""The runner's step timer (`StepClock`) and pinned output ring (`HostRing`), on the CPU.

A fake device stands in for CUDA: its marks are recorded in order on one stream and complete only when
the test lets the device reach them, so the tests see exactly what `harvest()` does with marks the
device has not reached yet. The CPU's own host-clock marks run the same code.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from lockstep_engine.engine_core import CoreStats
from lockstep_engine.llm import LLM
from lockstep_engine.metrics import CoreMetrics
from lockstep_engine.runner.host_stream import HostRing, StepStream
from lockstep_engine.runner.outputs import StepOutput, StepTag, StepTiming, WindowTimings
from lockstep_engine.runner.step_clock import StepClock
from lockstep_engine.sampling_params import SamplingParams

from lockstep_common import metrics_names as n

CPU = torch.device("cpu")


class FakeDevice:
    """One in-order stream: marks are recorded at `now` and complete once the device `reached` them."""

    def __init__(self, completes_at_once: bool = False):
        self.now = 0.0
        self.recorded = 0
        self.reached = 0
        self.completes_at_once = completes_at_once
        self.syncs = 0

    def mark(self) -> FakeEvent:
        return FakeEvent(self)

    def release(self, marks: int | None = None) -> None:
        """Lets the device reach `marks` more recorded marks (all of them when None)."""
        self.reached = self.recorded if marks is None else min(self.reached + marks, self.recorded)


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device = device
        self.seq = 0
        self.at = 0.0

    def record(self) -> None:
        self.device.recorded += 1
        self.seq, self.at = self.device.recorded, self.device.now
        if self.device.completes_at_once:
            self.device.reached = self.seq

    def query(self) -> bool:
        return self.seq <= self.device.reached

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.reached = max(self.device.reached, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on a mark the device has not reached"
        return (end.at - self.at) * 1e3


def _clock(device: FakeDevice, pool_size: int = 512) -> StepClock:
    return StepClock(CPU, pool_size=pool_size, mark_factory=device.mark)


def _window(clock: StepClock, device: FakeDevice, continuing: bool, starts_at: float, num_steps: int,
            forward: float = 0.010, gap: float = 0.001) -> float:
    """Records a window of equal steps from `starts_at`; returns when its last forward ended."""
    clock.begin_window(continuing)
    at = starts_at
    for step in range(1, num_steps + 1):
        device.now = at
        clock.start(StepTag(step, "decode", 4))
        device.now = at + forward
        clock.end()
        at += forward + gap
    return at - gap


def _summary(timings) -> list[tuple[int, float, float | None]]:
    return [(t.tag.step, round(t.forward_s, 9), None if t.gap_s is None else round(t.gap_s, 9)) for t in timings]


def test_first_step_after_idle_has_no_gap_and_back_to_back_windows_have_a_boundary_gap():
    device = FakeDevice(completes_at_once=True)
    clock = _clock(device)
    ended = _window(clock, device, continuing=False, starts_at=1.0, num_steps=3)
    assert _summary(clock.harvest()) == [(1, 0.01, None), (2, 0.01, 0.001), (3, 0.01, 0.001)]
    ended = _window(clock, device, continuing=True, starts_at=ended + 0.0004, num_steps=2)
    assert _summary(clock.harvest()) == [(1, 0.01, 0.0004), (2, 0.01, 0.001)]
    _window(clock, device, continuing=False, starts_at=ended + 5.0, num_steps=1)  # the engine was idle
    assert _summary(clock.harvest()) == [(1, 0.01, None)]
    assert clock.num_forced_syncs == 0 and device.syncs == 0


def test_dropped_start_is_no_forward_and_the_next_gap_counts_from_the_last_real_one():
    device = FakeDevice(completes_at_once=True)
    clock = _clock(device)
    ended = _window(clock, device, continuing=False, starts_at=0.0, num_steps=2)
    device.now = ended + 0.001
    clock.start(StepTag(3, "decode", 4))  # every row had stopped: the step runs nothing
    clock.drop_start()
    _window(clock, device, continuing=True, starts_at=ended + 0.002, num_steps=1)
    assert _summary(clock.harvest()) == [(1, 0.01, None), (2, 0.01, 0.001), (1, 0.01, 0.002)]


def test_harvest_never_waits_and_returns_unfinished_forwards_later_in_order():
    device = FakeDevice()
    clock = _clock(device)
    ended = _window(clock, device, continuing=False, starts_at=0.0, num_steps=3)
    assert clock.harvest() == []  # the device has reached none of the marks
    device.release(3)  # step 1, and the start of step 2
    assert _summary(clock.harvest()) == [(1, 0.01, None)]
    _window(clock, device, continuing=True, starts_at=ended + 0.0005, num_steps=2)
    device.release(2)  # step 2 only
    assert _summary(clock.harvest()) == [(2, 0.01, 0.001)]
    device.release()
    assert _summary(clock.harvest()) == [(3, 0.01, 0.001), (1, 0.01, 0.0005), (2, 0.01, 0.001)]
    assert clock.harvest() == []
    assert device.syncs == 0 and clock.num_forced_syncs == 0


def test_a_small_pool_is_reused_over_many_windows_without_losing_a_forward():
    device = FakeDevice(completes_at_once=True)
    clock = _clock(device, pool_size=4)
    ended, harvested = -0.002, []
    for window in range(500):
        ended = _window(clock, device, continuing=window > 0, starts_at=ended + 0.002, num_steps=7)
        harvested += clock.harvest()
    assert device.recorded == 2 * 500 * 7 and len(harvested) == 500 * 7
    assert [t.tag.step for t in harvested] == list(range(1, 8)) * 500
    assert {round(t.forward_s, 9) for t in harvested} == {0.01}
    assert harvested[0].gap_s is None
    assert {round(t.gap_s, 9) for t in harvested[1:] if t.tag.step == 1} == {0.002}
    assert {round(t.gap_s, 9) for t in harvested if t.tag.step > 1} == {0.001}
    assert clock.num_forced_syncs == 0 and device.syncs == 0


def test_an_exhausted_pool_waits_for_the_oldest_forward_and_counts_it():
    device = FakeDevice()
    clock = _clock(device, pool_size=4)
    _window(clock, device, continuing=False, starts_at=0.0, num_steps=3)  # 6 marks from a pool of 4
    assert clock.num_forced_syncs == 2 and device.syncs == 4  # steps 1 and 2, both marks each
    device.release()
    assert _summary(clock.harvest()) == [(1, 0.01, None), (2, 0.01, 0.001), (3, 0.01, 0.001)]


def test_a_window_that_raised_leaves_no_open_start_behind():
    device = FakeDevice(completes_at_once=True)
    clock = _clock(device)
    clock.begin_window(False)
    clock.start(StepTag(1, "prefill", 1))  # the forward raised before end()
    _window(clock, device, continuing=False, starts_at=1.0, num_steps=2)
    assert _summary(clock.harvest()) == [(1, 0.01, None), (2, 0.01, 0.001)]


def test_pool_size_below_four_is_rejected():
    with pytest.raises(ValueError, match="pool_size=3"):
        StepClock(CPU, pool_size=3)


def test_cpu_clock_reads_the_host_clock_between_forwards():
    clock = StepClock(CPU)
    clock.begin_window(False)
    before = time.perf_counter()
    clock.start(StepTag(1, "prefill", 1))
    torch.ones(64, 64) @ torch.ones(64, 64)
    clock.end()
    clock.start(StepTag(2, "decode", 1))
    clock.end()
    after = time.perf_counter()
    first, second = clock.harvest()
    assert first.gap_s is None and 0 < first.forward_s < after - before
    assert 0 <= second.gap_s and first.forward_s + second.gap_s + second.forward_s <= after - before


# ---- pinned output ring ---------------------------------------------------------------------
def _stream(ring: HostRing | None):
    got: list[StepOutput] = []
    return StepStream(got.append, WindowTimings(), ring), got


def _cpu_ring(device: FakeDevice, allocations: list) -> HostRing:
    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        allocations.append((numel, dtype))
        return torch.empty(numel, dtype=dtype)

    return HostRing(allocate=allocate, event_factory=device.mark)


def test_async_steps_are_delivered_in_order_once_their_copy_landed():
    device, allocations = FakeDevice(), []
    ring = _cpu_ring(device, allocations)
    stream, got = _stream(ring)
    stream.push(1, torch.tensor([5, 6]), None, sync=False)
    stream.push(2, torch.tensor([7, -1]), None, sync=False)
    assert got == []  # neither copy has landed
    device.release(1)
    stream.push(3, torch.tensor([8, -1]), None, sync=False)
    assert [(o.step, o.tokens) for o in got] == [(1, [5, 6])]
    stream.drain()
    assert [(o.step, o.tokens) for o in got] == [(1, [5, 6]), (2, [7, -1]), (3, [8, -1])]
    assert ring.num_slots == 3


def test_ring_slots_are_reused_across_windows_and_grow_for_a_larger_batch():
    device, allocations = FakeDevice(completes_at_once=True), []
    ring = _cpu_ring(device, allocations)
    for window in range(50):
        stream, got = _stream(ring)
        for step in range(1, 9):
            stream.push(step, torch.full((3,), 100 * window + step), None, sync=False)
        stream.drain()
        assert [o.tokens for o in got] == [[100 * window + step] * 3 for step in range(1, 9)]
    assert ring.num_slots == 1 and allocations == [(4, torch.int64)]
    stream, got = _stream(ring)
    out = SimpleNamespace(logprobs=torch.tensor([-0.5] * 9), ranks=torch.tensor([1] * 9),
                          top_ids=torch.arange(18).view(9, 2), top_logprobs=torch.zeros(9, 2))
    stream.push(1, torch.arange(9), out, sync=False)
    stream.drain()
    assert got[0].tokens == list(range(9)) and got[0].ranks == [1] * 9 and got[0].top_ids[8] == [16, 17]
    assert allocations[1:] == [(16, torch.int64), (16, torch.float32), (16, torch.int64), (32, torch.int64),
                               (32, torch.float32)]


def test_sync_steps_read_the_device_tensors_and_need_no_ring():
    stream, got = _stream(None)
    stream.push(1, torch.tensor([3, 4]), None, sync=True)
    assert got[0].tokens == [3, 4] and stream.last_tokens == [3, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events and pinned memory need a GPU")
def test_cuda_events_and_pinned_ring_time_a_window_without_waiting_on_the_clock():
    device = torch.device("cuda")
    clock, ring, x = StepClock(device), HostRing(), torch.randn(1024, 1024, device=device)
    for window in range(3):
        stream, got = _stream(ring)
        clock.begin_window(window > 0)
        for step in range(1, 21):
            clock.start(StepTag(step, "decode", 4))
            x = torch.tanh(x @ x)
            clock.end()
            stream.push(step, torch.full((4,), 100 * window + step, device=device), None, sync=False)
        stream.drain()  # the last copy was queued after the last mark: every mark is complete
        harvested = clock.harvest()
        assert [t.tag.step for t in harvested] == list(range(1, 21))
        assert all(t.forward_s > 0 for t in harvested)
        assert (harvested[0].gap_s is None) == (window == 0) and all(t.gap_s >= 0 for t in harvested[1:])
        assert [o.tokens for o in got] == [[100 * window + step] * 4 for step in range(1, 21)]
    assert clock.num_forced_syncs == 0 and ring.num_slots <= 20


# ---- the engine -----------------------------------------------------------------------------
def test_engine_steps_pair_with_their_timings(tiny):
    # Overlap off: with it, a window's last forward is harvested by the next window.
    llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=4, num_gpu_blocks_override=256,
              max_num_seqs=8, async_scheduling=False)
    forced_before = llm.engine.executor.runner.clock.num_forced_syncs
    prompts = [{"prompt_token_ids": [3 + i, 7, 11 + i]} for i in range(5)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    stats = llm.engine.core.stats
    # Every window here samples, so its outputs reached the host after its last forward: each window
    # harvests its own forwards.
    decode_steps = stats.num_steps - stats.num_windows
    assert len(stats.decode_step_s) == len(stats.decode_step_batch) == len(stats.gaps_s) == decode_steps
    assert set(stats.decode_step_batch) <= set(range(1, 6)) and stats.forward_s > 0
    assert len(stats.boundary_gaps_s) == stats.num_windows - 1  # one batch, back to back after the first
    assert llm.engine.executor.runner.clock.num_forced_syncs == forced_before


def test_a_step_harvested_a_window_late_keeps_its_own_phase_and_boundary():
    core = SimpleNamespace(stats=CoreStats(decode_step_s=[0.002], decode_step_batch=[3]),
                           scheduler=SimpleNamespace(num_preemptions=0),
                           blocks=SimpleNamespace(prefix_cache_queries=0, prefix_cache_hits=0))
    metrics = CoreMetrics()
    late_prefill = StepTiming(StepTag(1, "prefill", 0), 0.030, None)  # a prefill-only window's forward
    steps = [late_prefill, StepTiming(StepTag(1, "decode", 3), 0.002, 4e-4),
             StepTiming(StepTag(2, "decode", 3), 0.002, 5e-6)]
    metrics.record_window(core.stats.take(), WindowTimings(num_steps=2, steps=steps))
    snapshot = metrics.snapshot(core)
    assert snapshot.counters[n.STEPS] == {("prefill", "window_start"): 1, ("decode", "window_start"): 1,
                                          ("decode", "intra"): 1}
    assert snapshot.counters[n.GPU_BUSY] == {("prefill",): 0.030, ("decode",): 0.004}
    assert set(snapshot.histograms[n.STEP_GAP]) == {("decode", "window_start"), ("decode", "intra")}
    assert snapshot.histograms[n.WINDOW_STEPS][()][1] == 2  # the steps this window executed
    assert core.stats.decode_step_s == core.stats.decode_step_batch == []  # drained as pairs


@pytest.mark.parametrize("overlap", (False, True))
def test_the_last_windows_timings_are_taken_when_the_engine_goes_idle(tiny, overlap, monkeypatch):
    """On a device whose marks complete only once the host waits on a later one (as CUDA's copy events and
    the forwards before them), a window's own harvest finds its last forwards running; with overlap its last
    steps are even handed over after it. Once no window follows, the engine takes them then: every forward
    is timed before new traffic comes (a server's metrics while idle), none twice."""
    from lockstep_engine.runner.cuda_graphs import DecodeGraphs

    device = FakeDevice()
    llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=8, num_gpu_blocks_override=256,
              max_num_seqs=8, async_scheduling=overlap)
    runner = llm.engine.executor.runner  # the shared model's: what is changed here is put back after
    monkeypatch.setattr(runner, "graphs", DecodeGraphs(runner.steps, capture=False))  # the CUDA paths, on the CPU
    monkeypatch.setattr(runner, "host_ring", HostRing(allocate=lambda numel, dtype: torch.empty(numel, dtype=dtype),
                                                      event_factory=device.mark))
    clock = StepClock(CPU, mark_factory=device.mark)
    monkeypatch.setattr(runner, "clock", clock)
    harvested = []
    harvest = clock.harvest
    clock.harvest = lambda: harvested.extend(timings := harvest()) or timings
    out = llm.generate([{"prompt_token_ids": list(range(300, 311))}],
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = llm.engine.core.stats
    assert len(out[0].outputs[0].token_ids) == 40 and stats.num_steps == 40
    assert [t.tag.step for t in harvested] == [step for _ in range(5) for step in range(1, 9)]
    if overlap:  # the handed-over steps' forwards: the last window's harvest ran before them
        assert stats.idle_steps and stats.idle_steps == harvested[-len(stats.idle_steps):]
    else:  # the window's last step was waited for before its harvest
        assert stats.idle_steps == []
    assert len(stats.decode_step_s) == 35 and clock.num_forced_syncs == 0
