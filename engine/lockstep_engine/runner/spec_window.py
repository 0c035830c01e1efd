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
tokens one at a time as without speculation. Speculative windows are synchronous (no overlap tail)
and run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

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


class SpecWindow:
    """One speculative window's device state and steps."""

    def __init__(self, steps: Steps, plan: WindowPlan, draft, on_step: Callable[[StepOutput], None],
                 timings: WindowTimings):
        self.steps, self.spec, self.draft = steps, plan.speculation, draft
        self.k = self.spec.num_speculative_tokens
        self.on_step, self.timings = on_step, timings
        self.counts = SpecCounts(accepted_per_pos=(0,) * self.k)

    def start(self, state: DecodeState, seqs: list, max_dec_len: int) -> None:
        """The rows' tokens (prompt and outputs, the last one `state.tokens`) as the proposers' history."""
        self.state, self.max_dec_len = state, max_dec_len
        steps = self.steps
        self.layout = QueryLayout(state.table, steps.block_size, steps.sink_slot, steps.max_model_len)
        known = pad_rows([seq.token_ids for seq in seqs], 0)
        width = known.shape[1] + 2 + int(state.max_steps.max()) + self.k  # room for every token the window takes
        history = torch.zeros(len(seqs), width, dtype=torch.int64)
        history[:, :known.shape[1]] = torch.from_numpy(known)
        self.history = history.to(steps.device)
        self.history.scatter_(1, state.positions.unsqueeze(1), state.tokens.unsqueeze(1))

    def propose(self, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Drafts [rows, K], the draft's distributions or None, and which rows proposed."""
        state, spec = self.state, self.spec
        if spec.is_ngram:
            drafts, found = propose_ngram(self.history, state.positions + 1, self.k, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max)
            return drafts, None, found
        previous = self.history.gather(1, (state.positions - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        drafts, q = self.draft.propose(self.layout, previous, state.tokens, state.positions, state.done,
                                       state.sampling, state.num_generated, self.k, max_seq_len)
        return drafts, q, torch.ones_like(state.done)

    def step(self, number: int) -> None:
        """Speculative step `number` of the window (1-based); its tokens go to the host."""
        state, steps = self.state, self.steps
        rows = state.tokens.shape[0]
        # Longest context this step can see: the window's longest row plus K + 1 per earlier step.
        max_seq_len = self.max_dec_len + number * (self.k + 1)
        drafts, q, proposed = self.propose(max_seq_len)
        if q is None and not bool(proposed.any()):
            drafts = drafts[:, :0]  # no row found its suffix earlier: a plain decode step, no K wasted positions
        k = drafts.shape[1]
        offsets = torch.arange(k + 1, device=steps.device)
        at = state.positions.unsqueeze(1) + offsets  # [rows, K + 1]
        ids = torch.cat((state.tokens.unsqueeze(1), drafts), dim=1)
        # a row that proposed nothing (no n-gram match) verifies its own position only
        keep = None if q is not None or not k else (offsets == 0) | proposed.unsqueeze(1)
        raw = self._target_logits(ids, at, None if keep is None or bool(keep.all()) else keep, max_seq_len)
        t = expand_rows(state.sampling, k + 1)
        counters = position_counts(state.num_generated, k + 1)
        logits = Sampler.processed_logits(raw, t, counters)
        tokens, accepted = verify(logits.view(rows, k + 1, -1), drafts, q, t, counters,
                                  None if q is not None else proposed)
        self._count(accepted, proposed & ~state.done)
        count = self._advance(tokens, accepted)
        logprobs = None
        if state.sampling.num_logprobs >= 0:
            logprobs = _logprobs(raw, tokens.flatten(), state.sampling.num_logprobs)
        self._emit(number, tokens, count, logprobs)

    def _target_logits(self, ids: torch.Tensor, at: torch.Tensor, keep: torch.Tensor | None,
                       max_seq_len: int) -> torch.Tensor:
        """The target's float32 logits at every position of `at` [rows, K + 1] ([rows * (K + 1), vocab]).
        With `keep`, only the kept positions run through the model (rows verify different numbers of
        positions); the others' logits are zeros, which no row takes a token from."""
        state, steps = self.state, self.steps
        if keep is None:
            hidden = steps.forward(ids.flatten(), self.layout.clamp(at).flatten(),
                                   self.layout.meta(at, state.done, max_seq_len))
            return steps.model.compute_logits(hidden).float()
        kept = keep.flatten().nonzero().squeeze(1)
        positions = at.flatten().index_select(0, kept)
        rows = kept // at.shape[1]
        hidden = steps.forward(ids.flatten().index_select(0, kept), self.layout.clamp(positions),
                               self.layout.meta(positions, state.done, max_seq_len, rows=rows))
        logits = steps.model.compute_logits(hidden).float()
        raw = logits.new_zeros(at.numel(), logits.shape[1])
        raw.index_copy_(0, kept, logits)
        return raw

    def _advance(self, tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """Takes each row's accepted drafts and bonus token, cut at its first stop token and at what it may
        still take; moves its state on by that count. Returns the counts [rows]."""
        state, k = self.state, tokens.shape[1] - 1
        valid = ~state.done
        offsets = torch.arange(k + 1, device=tokens.device).unsqueeze(0)
        is_stop = (tokens.unsqueeze(2) == state.sampling.stop_ids.unsqueeze(1)).any(dim=2)  # [rows, K + 1]
        first_stop = torch.where(is_stop, offsets, k + 1).amin(dim=1)
        count = torch.minimum(accepted + 1, state.max_steps - state.steps_done)
        hit_stop = (first_stop < count) & valid
        count = torch.where(hit_stop, first_stop + 1, count) * valid
        last = tokens.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        index = (state.positions.unsqueeze(1) + 1 + offsets).clamp(max=self.history.shape[1] - 1)
        keep = offsets < count.unsqueeze(1)
        self.history.scatter_(1, index, torch.where(keep, tokens, self.history.gather(1, index)))
        state.tokens = torch.where(count > 0, last, state.tokens)
        state.positions = state.positions + count
        state.steps_done = state.steps_done + count
        state.num_generated = state.num_generated + count
        at_limit = (state.steps_done >= state.budget) & valid
        self.finish = torch.where(hit_stop, FINISH_STOP, torch.where(at_limit, FINISH_LENGTH, FINISH_NONE))
        state.done = state.done | hit_stop | (state.steps_done >= state.max_steps)
        return count

    def _count(self, accepted: torch.Tensor, proposed: torch.Tensor) -> None:
        """Counts the drafts of the rows that proposed (a row done before the step proposes nothing)."""
        k = self.k
        rows = int(proposed.sum())
        taken = torch.where(proposed, accepted, 0)
        per_pos = (taken.unsqueeze(1) > torch.arange(k, device=taken.device)).sum(dim=0).tolist()
        self.counts = self.counts.plus(SpecCounts(rows, rows * k, int(taken.sum()), tuple(per_pos)))

    def _emit(self, number: int, tokens: torch.Tensor, count: torch.Tensor, logprobs) -> None:
        """One host output per token position that some row took."""
        started = time.perf_counter()
        tokens, count, finish = tokens.tolist(), count.tolist(), self.finish.tolist()
        if logprobs is not None:
            logprobs = [x.view(len(count), len(tokens[0]), *x.shape[1:]).tolist() if x is not None else None
                        for x in logprobs]
        for j in range(max(count, default=0)):
            out = StepOutput(number, [row[j] if j < n else -1 for row, n in zip(tokens, count)],
                             [code if j == n - 1 else FINISH_NONE for code, n in zip(finish, count)])
            if logprobs is not None:
                chosen, ranks, top_logprobs, top_ids = ([row[j] for row in x] if x is not None else None
                                                        for x in logprobs)
                out.logprobs, out.ranks, out.top_logprobs, out.top_ids = chosen, ranks, top_logprobs, top_ids
            self.on_step(out)
        self.timings.output_s += time.perf_counter() - started


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> list:
    """Logprobs of the target's raw distribution at each position: chosen, rank, top k (None when k is 0)."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    return [chosen.squeeze(1), ranks, top_logprobs, top_ids]


def run_speculative(steps: Steps, plan: WindowPlan, draft, clock, on_step: Callable[[StepOutput], None],
                    continuing: bool, should_cut: Callable[[], bool] | None, started: float) -> WindowTimings:
    """Runs a speculative window (see the module docstring); `draft` is the draft model or None (n-gram)."""
    timings = WindowTimings()
    first = steps.first_step(plan.rows)
    rows_n = len(first.sampling_rows)
    timings.prepare_s = time.perf_counter() - started
    clock.begin_window(continuing)
    decode_only = rows_n == len(plan.rows) and first.input_ids.shape[0] == rows_n and first.prompt is None
    window = SpecWindow(steps, plan, draft, on_step, timings)
    done_steps = 0
    if decode_only:
        state = steps.decode_window_state(first)
        window.start(state, [row.seq for row in first.sampling_rows], first.max_dec_len)
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
        window.start(state, [row.seq for row in first.sampling_rows], first.max_dec_len)
        _emit_first(state, out, on_step, timings)
    for number in range(done_steps + 1, plan.num_steps + 1):
        if bool(state.done.all()) or number > 1 and should_cut is not None and should_cut():
            break
        clock.start(StepTag(number, "decode", rows_n))
        window.step(number)
        clock.end()
        timings.num_steps = number
    timings.spec = window.counts
    timings.steps = clock.harvest()
    return timings


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
