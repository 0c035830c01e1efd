"""A window whose steps speculate (`WindowPlan.speculation`): each step proposes K tokens per row (n-gram
prompt lookup or a draft model, `spec_decode`), verifies them in one target forward over K + 1 positions
per row (one for a row that proposed nothing: an n-gram row without a match), and takes the accepted
drafts and the bonus token.

A window with prompt tokens runs its first step as every window does (`Steps.first_step`: prefill
chunks and decodes, one sample per row; the draft model computes the same tokens into its cache); a
window of decode rows only speculates from its first step. Rows take different counts in one step:
positions, lengths, slots and the stop masks advance by each row's count on the device, and a row's
count is cut at its first stop token and at the tokens it may still take (max_tokens, max_model_len,
the window's reservation). Drafted positions that are rejected leave KV behind that a later step
overwrites before anything reads it (each query sees keys up to its own position only).

A step's tokens reach the host at once, as one output per token position (a row with fewer tokens
than another gets -1 in the later ones), so the engine core, streaming, stop strings and usage see
tokens one at a time as without speculation.

On CUDA a window's speculative steps run as replays of a captured graph per batch bucket (`SpecGraph`:
the proposal, n-gram lookup over a static history of max_model_len tokens per row or the draft model's
K forwards, the verify forward over K + 1 positions for every row, acceptance and advance), their
outputs copied to the host as each step's copy lands, so the host does not stop the device between
steps. Rows without an n-gram match verify K + 1 positions there too (a decode forward reads the
weights once whatever its few positions). Windows with logprobs, logit bias or bad words run eagerly,
and a row without a match then verifies its own position only. Speculative windows are synchronous
(no overlap tail into the next window).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from lockstep_engine.log import log
from lockstep_engine.runner.cuda_graphs import BUCKETS, MAX_STOP_IDS, StaticState, bucket_of, capture
from lockstep_engine.runner.host_stream import CopyQueue, HostRing
from lockstep_engine.runner.outputs import (FINISH_LENGTH, FINISH_NONE, FINISH_STOP, SpecCounts, StepOutput, StepTag,
                                           WindowTimings)
from lockstep_engine.runner.step_inputs import pad_rows
from lockstep_engine.runner.steps import Steps
from lockstep_engine.runner.window_state import DecodeState, first_step_phase
from lockstep_engine.sampler import Sampler
from lockstep_engine.scheduler import WindowPlan
from lockstep_engine.spec_decode.meta import QueryLayout
from lockstep_engine.spec_decode.ngram import propose_ngram
from lockstep_engine.spec_decode.rejection import expand_rows, position_counts, verify


class SpecTally:
    """A window's draft counters on the device, added to at every step without a host sync and read once
    at the window's end: drafts, draft tokens, accepted tokens, accepted at draft position 0..K-1."""

    def __init__(self, k: int, device: torch.device):
        self.k = k
        self.values = torch.zeros(3 + k, dtype=torch.int64, device=device)

    def add(self, accepted: torch.Tensor, proposed: torch.Tensor) -> None:
        """Counts the drafts of the rows that proposed (a row done before the step proposes nothing)."""
        taken = torch.where(proposed, accepted, 0)
        rows = proposed.sum()
        per_pos = (taken.unsqueeze(1) > torch.arange(self.k, device=taken.device)).sum(dim=0)
        self.values += torch.cat((torch.stack((rows, rows * self.k, taken.sum())), per_pos))

    def counts(self) -> SpecCounts:
        values = self.values.tolist()
        return SpecCounts(values[0], values[1], values[2], tuple(values[3:]))


def speculate(steps: Steps, spec, draft, state: DecodeState, history: torch.Tensor, layout: QueryLayout,
              tally: SpecTally, max_seq_len: int, ragged: bool) -> tuple[torch.Tensor, ...]:
    """One speculative step over `state`: proposes, verifies, accepts and advances the rows (`state` and
    `history` change). Returns the tokens [rows, K + 1] (a row's first `count` are its output), the
    counts [rows], the finish codes [rows] and the raw logits. `ragged`: the host may look at the
    proposals (eager windows): rows without one verify their own position only, and a step where no row
    proposed is a plain decode step; a captured step verifies K + 1 positions for every row."""
    rows = state.tokens.shape[0]
    drafts, q, proposed = _propose(spec, draft, state, history, layout, max_seq_len)
    if ragged and q is None and not bool(proposed.any()):
        drafts = drafts[:, :0]  # no row found its suffix earlier: a plain decode step, no K wasted positions
    k = drafts.shape[1]
    offsets = torch.arange(k + 1, device=steps.device)
    at = state.positions.unsqueeze(1) + offsets  # [rows, K + 1]
    ids = torch.cat((state.tokens.unsqueeze(1), drafts), dim=1)
    keep = None
    if ragged and q is None and k:  # a row that proposed nothing verifies its own position only
        keep = (offsets == 0) | proposed.unsqueeze(1)
        keep = None if bool(keep.all()) else keep
    raw = _target_logits(steps, state, layout, ids, at, keep, max_seq_len)
    t = expand_rows(state.sampling, k + 1)
    counters = position_counts(state.num_generated, k + 1)
    logits = Sampler.processed_logits(raw, t, counters)
    tokens, accepted = verify(logits.view(rows, k + 1, -1), drafts, q, t, counters,
                              None if q is not None else proposed)
    tally.add(accepted, proposed & ~state.done)
    count, finish = _advance(state, history, tokens, accepted)
    return tokens, count, finish, raw


def _propose(spec, draft, state: DecodeState, history: torch.Tensor, layout: QueryLayout,
             max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Drafts [rows, K], the draft's distributions or None, and which rows proposed."""
    k = spec.num_speculative_tokens
    if spec.is_ngram:
        drafts, found = propose_ngram(history, state.positions + 1, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return drafts, None, found
    previous = history.gather(1, (state.positions - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    drafts, q = draft.propose(layout, previous, state.tokens, state.positions, state.done, state.sampling,
                              state.num_generated, k, max_seq_len)
    return drafts, q, torch.ones_like(state.done)


def _target_logits(steps: Steps, state: DecodeState, layout: QueryLayout, ids: torch.Tensor, at: torch.Tensor,
                   keep: torch.Tensor | None, max_seq_len: int) -> torch.Tensor:
    """The target's float32 logits at every position of `at` [rows, K + 1] ([rows * (K + 1), vocab]).
    With `keep`, only the kept positions run through the model (rows verify different numbers of
    positions); the others' logits are zeros, which no row takes a token from."""
    if keep is None:
        hidden = steps.forward(ids.flatten(), layout.clamp(at).flatten(), layout.meta(at, state.done, max_seq_len))
        return steps.model.compute_logits(hidden).float()
    kept = keep.flatten().nonzero().squeeze(1)
    positions = at.flatten().index_select(0, kept)
    rows = kept // at.shape[1]
    hidden = steps.forward(ids.flatten().index_select(0, kept), layout.clamp(positions),
                           layout.meta(positions, state.done, max_seq_len, rows=rows))
    logits = steps.model.compute_logits(hidden).float()
    raw = logits.new_zeros(at.numel(), logits.shape[1])
    raw.index_copy_(0, kept, logits)
    return raw


def _advance(state: DecodeState, history: torch.Tensor, tokens: torch.Tensor,
             accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Takes each row's accepted drafts and bonus token, cut at its first stop token and at what it may
    still take; moves its state and history on by that count. Returns the counts and finish codes [rows]."""
    k = tokens.shape[1] - 1
    valid = ~state.done
    offsets = torch.arange(k + 1, device=tokens.device).unsqueeze(0)
    is_stop = (tokens.unsqueeze(2) == state.sampling.stop_ids.unsqueeze(1)).any(dim=2)  # [rows, K + 1]
    first_stop = torch.where(is_stop, offsets, k + 1).amin(dim=1)
    count = torch.minimum(accepted + 1, state.max_steps - state.steps_done)
    hit_stop = (first_stop < count) & valid
    count = torch.where(hit_stop, first_stop + 1, count) * valid
    last = tokens.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    index = (state.positions.unsqueeze(1) + 1 + offsets).clamp(max=history.shape[1] - 1)
    keep = offsets < count.unsqueeze(1)
    history.scatter_(1, index, torch.where(keep, tokens, history.gather(1, index)))
    state.tokens = torch.where(count > 0, last, state.tokens)
    state.positions = state.positions + count
    state.steps_done = state.steps_done + count
    state.num_generated = state.num_generated + count
    at_limit = (state.steps_done >= state.budget) & valid
    finish = torch.where(hit_stop, FINISH_STOP, torch.where(at_limit, FINISH_LENGTH, FINISH_NONE))
    state.done = state.done | hit_stop | (state.steps_done >= state.max_steps)
    return count, finish


def load_history(history: torch.Tensor, known: torch.Tensor, state: DecodeState) -> None:
    """The proposers' history of a window's rows: their tokens so far (`known`, [rows, L] on the host, padded),
    the last one `state.tokens` at `state.positions`, into `history` [rows, >= L] (zeros past them)."""
    history[:, :known.shape[1]].copy_(known)
    history.scatter_(1, state.positions.unsqueeze(1), state.tokens.unsqueeze(1))


def emit_positions(on_step: Callable[[StepOutput], None], timings: WindowTimings, number: int, tokens: list,
                   count: list, finish: list, logprobs: list | None = None) -> None:
    """One host output per token position that some row took (host lists of one step: tokens
    [rows][K + 1], count and finish [rows]; logprobs as `_logprobs` gives them, or None)."""
    started = time.perf_counter()
    for j in range(max(count, default=0)):
        out = StepOutput(number, [row[j] if j < n else -1 for row, n in zip(tokens, count)],
                         [code if j == n - 1 else FINISH_NONE for code, n in zip(finish, count)])
        if logprobs is not None:
            chosen, ranks, top_logprobs, top_ids = ([row[j] for row in x] if x is not None else None for x in logprobs)
            out.logprobs, out.ranks, out.top_logprobs, out.top_ids = chosen, ranks, top_logprobs, top_ids
        on_step(out)
    timings.output_s += time.perf_counter() - started


class SpecWindow:
    """One speculative window run eagerly: its device state and steps."""

    def __init__(self, steps: Steps, plan: WindowPlan, draft, on_step: Callable[[StepOutput], None],
                 timings: WindowTimings):
        self.steps, self.spec, self.draft = steps, plan.speculation, draft
        self.k = self.spec.num_speculative_tokens
        self.on_step, self.timings = on_step, timings
        self.tally = SpecTally(self.k, steps.device)

    def start(self, state: DecodeState, seqs: list, max_dec_len: int) -> None:
        """The rows' tokens (prompt and outputs, the last one `state.tokens`) as the proposers' history."""
        self.state, self.max_dec_len = state, max_dec_len
        steps = self.steps
        self.layout = QueryLayout(state.table, steps.block_size, steps.sink_slot, steps.max_model_len)
        known = torch.from_numpy(pad_rows([seq.token_ids for seq in seqs], 0))
        width = known.shape[1] + 2 + int(state.max_steps.max()) + self.k  # room for every token the window takes
        self.history = torch.zeros(len(seqs), width, dtype=torch.int64, device=steps.device)
        load_history(self.history, known, state)

    def step(self, number: int) -> None:
        """Speculative step `number` of the window (1-based); its tokens go to the host."""
        state = self.state
        # Longest context this step can see: the window's longest row plus K + 1 per earlier step.
        max_seq_len = self.max_dec_len + number * (self.k + 1)
        tokens, count, finish, raw = speculate(self.steps, self.spec, self.draft, state, self.history, self.layout,
                                               self.tally, max_seq_len, ragged=True)
        logprobs = None
        if state.sampling.num_logprobs >= 0:
            rows = len(count)
            logprobs = [x.view(rows, tokens.shape[1], *x.shape[1:]).tolist() if x is not None else None
                        for x in _logprobs(raw, tokens.flatten(), state.sampling.num_logprobs)]
        emit_positions(self.on_step, self.timings, number, tokens.tolist(), count.tolist(), finish.tolist(), logprobs)


class SpecGraph(StaticState):
    """A speculative step of one batch bucket, captured: the window's decode state, a history of
    max_model_len + K + 2 tokens per row (a view of the `SpecGraphs`' shared buffer), the step's outputs
    and the window's tally, all static. With a draft model its K forwards (over its own KV cache) are
    part of the graph."""

    def __init__(self, steps: Steps, spec, draft, bucket: int, greedy: bool, filtered: bool, pool,
                 capture_graph: bool, history: torch.Tensor):
        super().__init__(steps, bucket, greedy, filtered)
        k = spec.num_speculative_tokens
        i64 = dict(dtype=torch.int64, device=steps.device)
        self.history = history[:bucket]
        self.tally = SpecTally(k, steps.device)
        self.outputs = (torch.full((bucket, k + 1), -1, **i64), torch.zeros(bucket, **i64), torch.zeros(bucket, **i64))
        layout = QueryLayout(self.inputs["table"], steps.block_size, steps.sink_slot, steps.max_model_len)

        def body():
            state = self.state()
            results = speculate(steps, spec, draft, state, self.history, layout, self.tally, steps.max_model_len,
                                ragged=False)
            self.store(state)
            for buffer, value in zip(self.outputs, results):
                buffer.copy_(value)

        def reset():
            self.inputs["done"].fill_(True)
            self.tally.values.zero_()

        self.graph = capture(body, steps.device, pool, capture_graph, reset)

    def begin(self, state: DecodeState, seqs: list) -> None:
        """Loads a window's rows: their decode state and their tokens as the history."""
        self.load(state)
        self.tally.values.zero_()
        self.history.zero_()
        load_history(self.history[:len(seqs)], torch.from_numpy(pad_rows([seq.token_ids for seq in seqs], 0)), state)

    def step_outputs(self, rows: int) -> list[torch.Tensor]:
        """The last replayed step's tokens [rows, K + 1], counts and finish codes [rows]."""
        return [x[:rows] for x in self.outputs]


# The captured steps' shared history is [largest bucket, max_model_len + K + 2] int64, allocated after the
# KV cache was sized: above this many bytes (long contexts at many rows) speculative windows run eagerly.
MAX_HISTORY_BYTES = 256 << 20


class SpecGraphs:
    """The captured speculative steps of one runner's decode graphs (`DecodeGraphs`: its pool and capture
    setting) for one speculative config and its draft model (None: n-gram), one per batch bucket up to
    `max_rows` and sampling kind, sharing one history."""

    def __init__(self, graphs, spec, draft, max_rows: int):
        steps = graphs.steps
        self.graphs, self.spec, self.draft = graphs, spec, draft
        self.max_bucket = self.largest_bucket(max_rows)
        self.history = torch.zeros(self.max_bucket, steps.max_model_len + spec.num_speculative_tokens + 2,
                                   dtype=torch.int64, device=steps.device)
        self.captured: dict[tuple[int, bool, bool], SpecGraph] = {}
        self.failed: str | None = None  # why a capture failed: the config's windows then run eagerly

    @staticmethod
    def largest_bucket(max_rows: int) -> int:
        return bucket_of(min(max_rows, BUCKETS[-1]))

    @classmethod
    def fits(cls, max_rows: int, max_model_len: int, spec) -> bool:
        """Whether the shared history stays within MAX_HISTORY_BYTES."""
        return cls.largest_bucket(max_rows) * (max_model_len + spec.num_speculative_tokens + 2) * 8 <= MAX_HISTORY_BYTES

    def usable(self, state: DecodeState) -> bool:
        t = state.sampling
        return (self.failed is None and state.counts is None and t.num_logprobs < 0 and t.logit_bias is None
                and t.bad_last is None and t.stop_ids.shape[1] <= MAX_STOP_IDS and state.lora_slots is None
                and state.tokens.shape[0] <= self.max_bucket)

    def graph(self, rows: int, greedy: bool, filtered: bool) -> SpecGraph:
        bucket = bucket_of(rows)
        key = (bucket, greedy, filtered)
        if key not in self.captured:
            self.captured[key] = SpecGraph(self.graphs.steps, self.spec, self.draft, bucket, greedy, filtered,
                                           self.graphs.pool, self.graphs.capture, self.history)
        return self.captured[key]

    def begin(self, state: DecodeState, seqs: list) -> SpecGraph | None:
        """The bucket's graph loaded with the window's rows; None when its capture failed (logged once; this
        config's windows run eagerly from then on, as they would without graphs)."""
        try:
            graph = self.graph(len(seqs), state.sampling.all_greedy, state.sampling.any_filter)
        except RuntimeError as error:
            self.failed = f"{type(error).__name__}: {error}"
            log(f"speculative steps could not be captured as a CUDA graph ({self.failed[:300]}): "
                f"speculative windows run eagerly")
            return None
        graph.begin(state, seqs)
        return graph


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> list:
    """Logprobs of the target's raw distribution at each position: chosen, rank, top k (None when k is 0)."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    return [chosen.squeeze(1), ranks, top_logprobs, top_ids]


def run_speculative(steps: Steps, plan: WindowPlan, draft, clock, on_step: Callable[[StepOutput], None],
                    continuing: bool, should_cut: Callable[[], bool] | None, started: float,
                    graphs: SpecGraphs | None = None, ring: HostRing | None = None) -> WindowTimings:
    """Runs a speculative window (see the module docstring); `draft` is the draft model or None (n-gram);
    `graphs`: the runner's captured steps for this config and draft (None: eager), whose outputs go
    through `ring`."""
    timings = WindowTimings()
    first = steps.first_step(plan.rows)
    rows_n = len(first.sampling_rows)
    timings.prepare_s = time.perf_counter() - started
    clock.begin_window(continuing)
    decode_only = rows_n == len(plan.rows) and first.input_ids.shape[0] == rows_n and first.prompt is None
    done_steps = 0
    if decode_only:
        state = steps.decode_window_state(first)
    else:
        clock.start(StepTag(1, first_step_phase(plan), rows_n))
        hidden = steps.forward(first.input_ids, first.positions, first.meta)
        if draft is not None:
            draft.prefill(first.input_ids, first.positions, first.meta)
        if first.prompt is not None:
            on_step(StepOutput(1, [], prompt_logprobs=steps.prompt_logprobs(hidden, first)))
        timings.num_steps = done_steps = 1
        if not rows_n:
            clock.end()
            timings.steps = clock.harvest()
            return timings
        out = steps.sample_first(hidden, first, None)
        state = steps.decode_state(first, out)
        clock.end()
        _emit_first(state, out, on_step, timings)
    seqs = [row.seq for row in first.sampling_rows]
    graph = graphs.begin(state, seqs) if graphs is not None and plan.num_steps > done_steps and graphs.usable(
        state) else None
    if graph is not None:
        _replay_speculative(graph, rows_n, done_steps, plan.num_steps, clock, on_step, should_cut, ring, timings)
        timings.steps = clock.harvest()
        return timings
    window = SpecWindow(steps, plan, draft, on_step, timings)
    window.start(state, seqs, first.max_dec_len)
    for number in range(done_steps + 1, plan.num_steps + 1):
        if bool(state.done.all()) or number > 1 and should_cut is not None and should_cut():
            break
        clock.start(StepTag(number, "decode", rows_n))
        window.step(number)
        clock.end()
        timings.num_steps = number
    timings.spec = window.tally.counts()
    timings.steps = clock.harvest()
    return timings


def _replay_speculative(graph: SpecGraph, rows_n: int, done_steps: int, num_steps: int, clock,
                        on_step: Callable[[StepOutput], None], should_cut: Callable[[], bool] | None,
                        ring: HostRing | None, timings: WindowTimings) -> None:
    """The window's speculative steps as replays of `graph`; each step's tokens reach the host as its copy
    lands while the device runs the next. A cut is decided with one step in flight, as in plain windows."""
    def emit(number: int, values: list) -> None:
        emit_positions(on_step, timings, number, *values)

    copies = CopyQueue(ring, emit) if ring is not None else None
    for number in range(done_steps + 1, num_steps + 1):
        if number > 1 and should_cut is not None:
            if copies is not None:
                copies.drain(keep=1)
            if should_cut():
                break
        clock.start(StepTag(number, "decode", rows_n))
        graph.graph.replay()
        clock.end()
        timings.num_steps = number
        if copies is None:  # the CPU: the step's outputs are on the host at once
            emit(number, [x.tolist() for x in graph.step_outputs(rows_n)])
        else:
            copies.push(number, graph.step_outputs(rows_n))
    if copies is not None:
        copies.drain()
    timings.spec = graph.tally.counts()


def _emit_first(state: DecodeState, out, on_step: Callable[[StepOutput], None], timings: WindowTimings) -> None:
    started = time.perf_counter()
    tokens, finish = state.emitted.tolist()
    step = StepOutput(1, tokens, finish)
    if out.logprobs is not None:
        step.logprobs, step.ranks = out.logprobs.tolist(), out.ranks.tolist()
        if out.top_ids is not None:
            step.top_ids, step.top_logprobs = out.top_ids.tolist(), out.top_logprobs.tolist()
    on_step(step)
    timings.output_s += time.perf_counter() - started
