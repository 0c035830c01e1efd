"""A window over pipeline stages: one micro-batch per stage in flight, merged back into whole steps.

Each micro-batch runs its own multi-step window, interleaved so the stages work at once: while the
last stage computes micro-batch m at step k, the first stage computes micro-batch m+1. Hidden states
go to the next stage with asynchronous sends; a stage other than the last takes in micro-batch m's
samples (a broadcast from the last stage) only just before it needs them, at step k+1. Every rank
walks the same (step, micro-batch) order, so the broadcasts pair up without extra messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from lockstep_engine.runner.host_stream import HostRing, StepStream
from lockstep_engine.runner.outputs import FINISH_NONE, Guide, StepOutput, StepTag, WindowTimings
from lockstep_engine.runner.step_clock import StepClock
from lockstep_engine.runner.steps import Steps
from lockstep_engine.runner.window_state import DecodeState, FirstStep, first_step_phase, has_guided_rows
from lockstep_engine.sampler import SampleOutput
from lockstep_engine.scheduler import WindowPlan


@dataclass
class MicroBatch:
    """One pipeline micro-batch of a window: its own first step, decode state, guide and stream."""

    first: FirstStep
    state: DecodeState | None = None
    guide: Guide | None = None
    stream: StepStream | None = None
    table_len: int = 0
    awaiting: tuple[int, SampleOutput | None] | None = None  # (step, samples) not yet taken in
    finished: bool = False


def split_micro_batches(rows: list, count: int, num_steps: int) -> list[list]:
    """Splits a window's rows, in order, into at most `count` non-empty runs of similar work
    (tokens of step 1 plus the decode steps a sampling row adds)."""
    count = min(count, len(rows))
    weights = [row.num_new_tokens + (num_steps - 1 if row.samples else 0) for row in rows]
    total = sum(weights)
    parts: list[list] = []
    current: list = []
    done = 0
    for index, (row, weight) in enumerate(zip(rows, weights)):
        current.append(row)
        done += weight
        parts_left = count - len(parts) - 1
        rows_left = len(rows) - index - 1
        if parts_left and rows_left >= parts_left and (
                done >= total * (len(parts) + 1) / count or rows_left == parts_left):
            parts.append(current)
            current = []
    parts.append(current)
    return parts


class StepMerger:
    """Joins the micro-batches' outputs of a step into one StepOutput over all sampling rows (the
    micro-batches are consecutive runs of the plan's rows) and hands complete steps on in order."""

    def __init__(self, on_step: Callable[[StepOutput], None], sizes: list[int]):
        self.on_step = on_step
        self.sizes = sizes
        self.parts: dict[int, list] = {}

    def add(self, step: int, index: int, out: StepOutput | None) -> None:
        parts = self.parts.setdefault(step, [None] * len(self.sizes))
        parts[index] = out if out is not None else StepOutput(step=step, tokens=[-1] * self.sizes[index])
        if all(part is not None or size == 0 for part, size in zip(parts, self.sizes)):
            del self.parts[step]
            self.on_step(self._join(step, parts))

    def _join(self, step: int, parts: list) -> StepOutput:
        parts = [p if p is not None else StepOutput(step=step, tokens=[]) for p in parts]
        out = StepOutput(step=step, tokens=[t for p in parts for t in p.tokens])
        if any(p.finish is not None for p in parts):
            out.finish = [x for p in parts for x in (p.finish or [FINISH_NONE] * len(p.tokens))]
        if any(p.logprobs is not None for p in parts):
            out.logprobs = [x for p in parts for x in (p.logprobs or [0.0] * len(p.tokens))]
            out.ranks = [x for p in parts for x in (p.ranks or [0] * len(p.tokens))]
        if any(p.top_ids is not None for p in parts):
            out.top_ids = [x for p in parts for x in (p.top_ids or [[]] * len(p.tokens))]
            out.top_logprobs = [x for p in parts for x in (p.top_logprobs or [[]] * len(p.tokens))]
        return out


def run_pipelined(steps: Steps, clock: StepClock, ring: HostRing | None, make_guide: Callable[[list], Guide | None],
                  micro_batches: int, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                  continuing: bool, started: float) -> WindowTimings:
    """The window split into at most `micro_batches` micro-batches; `started`: when the window's host
    preparation began (its block copies are done)."""
    timings = WindowTimings()
    parts = split_micro_batches(plan.rows, micro_batches, plan.num_steps)
    batches = [MicroBatch(steps.first_step(rows)) for rows in parts]
    merger = StepMerger(on_step, [len(b.first.sampling_rows) for b in batches])
    # The host needs each step's tokens before the next (guided rows; early exit on the CPU).
    sync = steps.device.type != "cuda" or has_guided_rows(plan.rows)
    for index, batch in enumerate(batches):
        batch.guide = make_guide(batch.first.sampling_rows)
        batch.stream = StepStream(lambda out, index=index: merger.add(out.step, index, out), timings, ring)
        batch.table_len = batch.first.block_table.shape[1] * steps.block_size
    timings.prepare_s = time.perf_counter() - started

    rows_n = len(plan.sampling_rows)
    clock.begin_window(continuing)
    sends: list = []
    last_stage = steps.state.is_last_stage
    for step in range(1, plan.num_steps + 1):
        clock.start(StepTag(step, first_step_phase(plan) if step == 1 else "decode", rows_n))
        idle = []
        for index, batch in enumerate(batches):
            if batch.awaiting is not None:  # this stage's deferred intake of step - 1
                _take_samples(steps, batch, sync)
            if batch.finished:
                idle.append(index)
                continue
            batch.awaiting = (step, _micro_forward(steps, batch, step, sends))
            if not batch.first.sampling_rows:  # prefill chunks only: nothing to sample
                batch.awaiting, batch.finished = None, True
            elif last_stage:
                _take_samples(steps, batch, sync)
        if len(idle) == len(batches):  # every row stopped: the window ends early on every rank
            clock.drop_start()
            break
        clock.end()
        timings.num_steps = step
        for index in idle:
            merger.add(step, index, None)
    for batch in batches:
        if batch.awaiting is not None:
            _take_samples(steps, batch, sync)
        batch.stream.drain()
    for work, _ in sends:
        work.wait()
    timings.steps = clock.harvest()
    return timings


def _micro_forward(steps: Steps, batch: MicroBatch, step: int, sends: list) -> SampleOutput | None:
    """This stage's share of one micro-batch step; the samples on the last stage, else None."""
    first = batch.first
    if step == 1:
        hidden = steps.forward(first.input_ids, first.positions, first.meta, sends)
        if not first.sampling_rows:
            return None
        return steps.sample_first(hidden, first, batch.guide)
    return steps.decode_forward(batch.state, min(first.max_dec_len + step - 1, batch.table_len), batch.guide, sends)


def _take_samples(steps: Steps, batch: MicroBatch, sync: bool) -> None:
    """Adopts the last stage's samples of the micro-batch's pending step and feeds them back."""
    step, out = batch.awaiting
    batch.awaiting = None
    first = batch.first
    if step == 1:
        out = steps.share_samples(out, first.sampling, len(first.sampling_rows))
        batch.state = steps.decode_state(first, out)
    else:
        out = steps.take(batch.state, out)
    batch.stream.push(step, batch.state.emitted, out, sync=sync)
    if batch.guide is not None:
        batch.guide.accept(batch.stream.last_tokens)
    if sync:
        batch.finished = bool(batch.state.done.all())
