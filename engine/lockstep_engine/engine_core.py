"""`EngineCore`: the loop `schedule -> run window -> update`, emitting tokens per step.

The device decides the stops it can see (EOS, stop token ids, max_tokens, max_model_len) and sends a
finish code per row with each step's tokens; the core applies it. Stop strings are the output
processor's call: it stops a sequence through `stop_sequence`, and any token the window computed
for it afterwards is counted as wasted.

One request's error does not end the engine: what the core does for one request (forking its
samples, preparing its window state, taking its tokens) runs inside a boundary that fails that
request alone (`fail_request`: its client gets a `RequestFailed`, its blocks are freed). What a
window does for all its rows at once (the device, the group's collectives) is not bounded here: an
error there is fatal, and the core process exits.
"""

from __future__ import annotations

import itertools
import sys
import time
import traceback
from functools import partial
from typing import Callable

from lockstep_engine.protocol import RequestFailed, SequenceOutput, StepOutputs, TokenBatch, TokenLogprobs
from lockstep_engine.adapter_slots import AdapterSlots
from lockstep_engine.block_manager import BlockManager
from lockstep_engine.config import EngineConfig
from lockstep_engine.core_stats import CoreStats
from lockstep_engine.group.executor import Executor
from lockstep_engine.log import log
from lockstep_engine.runner.outputs import FINISH_LENGTH, FINISH_STOP, StepOutput, WindowTimings
from lockstep_engine.scheduler import ScheduledSeq, Scheduler, SchedulerLimits, WindowPlan
from lockstep_engine.sequence import Request, Sequence, SequenceStatus
from lockstep_engine.spec_decode.requests import check_speculative


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor):
        self.config = config
        self.executor = executor
        # A shared model may hold more KV memory than this engine is configured to use.
        num_blocks = min(executor.num_blocks, config.num_gpu_blocks_override or executor.num_blocks)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # With pipeline stages the limits hold per micro-batch, as they do per virtual engine in vLLM:
        # a window of PP micro-batches carries up to PP x max_num_seqs rows.
        micro = executor.micro_batches
        batched = config.max_num_batched_tokens * micro if config.max_num_batched_tokens else None
        self.scheduler = Scheduler(
            SchedulerLimits(max_num_seqs=config.max_num_seqs * micro, max_num_batched_tokens=batched,
                            max_model_len=config.max_model_len, num_scheduler_steps=config.num_scheduler_steps,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            scheduling_policy=config.scheduling_policy, lof_max_wait_s=config.lof_max_wait_s,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            max_long_partial_prefills=config.max_long_partial_prefills,
                            speculation=config.speculative_config),
            self.blocks, adapters=AdapterSlots.start(config, executor.runner.read_lora))
        self.requests: dict[str, Request] = {}
        # Requests with n > 1 whose samples are not forked yet, in arrival order: a window looks at these
        # alone, not at every request.
        self._unforked: dict[Request, None] = {}
        self.stats = CoreStats()
        self._in_flight: WindowPlan | None = None
        self._pending_release: list[Sequence] = []  # finished; blocks freed when no window is in flight
        self._busy = False  # work was left after the last window: the next one's wait counts as a gap
        self._failures: list[RequestFailed] = []  # requests failed since the last `take_failures`
        # Overlap: a window's last step is handed over by the next window (see `step`); auto: where the
        # device runs ahead of the host (CUDA).
        overlap = config.async_scheduling if config.speculative_config is None else False  # speculation: synchronous
        self._overlap = executor.can_defer_tail and (overlap if overlap is not None else executor.device.type == "cuda")
        if config.speculative_config is not None:  # a draft model loads now: one that cannot be used fails the start
            executor.runner.draft_model(config.speculative_config)
        self._tail = None  # the last window's undelivered last step (`runner.host_stream.WindowTail`)
        # Overlap: running sequences whose filled blocks enter the prefix cache after the next launch
        self._unhashed: list[Sequence] = []

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if request.prompt_len + 1 > capacity:
            raise ValueError(f"prompt of {request.prompt_len} tokens does not fit the KV cache "
                             f"({capacity} token slots)")
        check_speculative(self.config.speculative_config, request)
        self.requests[request.request_id] = request
        if not request.forked:
            self._unforked[request] = None
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> list[SequenceOutput]:
        """Aborts a request at any time; blocks of a sequence in flight are freed when its window ends."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        request.aborted = True
        outputs = []
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                outputs.append(SequenceOutput(request_id, seq.index, [], None, "abort"))
        if not self._in_flight:
            self._release_finished()
        return outputs

    def stop_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """The output processor found a stop string: the sequence ends at the token it last saw."""
        request = self.requests.get(request_id)
        if request is None:
            return
        seq = request.sequences[index]
        if not seq.is_finished:
            seq.stop_reason = stop_reason
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        if not self._in_flight:
            self._release_finished()

    def fail_request(self, request_id: str, what: str) -> None:
        """Ends one request on an error the engine hit while `what` (call it from the `except`: the
        traceback goes to the server log under the request's id). Its blocks are freed (when the window
        in flight ends, if one is), its client is told through `take_failures`, the others go on."""
        error = sys.exc_info()[1]
        log(f"error: request {request_id} failed while {what}; the engine goes on:\n{traceback.format_exc()}")
        self._failures.append(RequestFailed(request_id, f"the engine failed the request while {what} "
                                                        f"({type(error).__name__})", internal=True))
        request = self.requests.get(request_id)
        if request is None:
            return  # it had ended already: only its client is left to tell
        request.aborted = True
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if not self._in_flight:
            self._release_finished()

    def take_failures(self) -> list[RequestFailed]:
        """The requests `fail_request` ended since the last call, for their clients."""
        failures, self._failures = self._failures, []
        return failures

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- the loop ---------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self._pending_release.append(seq)

    def _release_finished(self) -> None:
        """Frees the blocks of sequences that finished, and forgets requests with nothing left to run.

        A request only ends when one of its sequences does, so only those requests are looked at.
        """
        released, self._pending_release = self._pending_release, []
        for seq in released:  # (its computed blocks enter the prefix cache first: `Scheduler.finish`)
            self.scheduler.finish(seq, seq.status)
        for request in dict.fromkeys(seq.request for seq in released):
            done = request.is_finished or request.aborted and all(s.is_finished for s in request.sequences)
            if done and self.requests.get(request.request_id) is request:
                del self.requests[request.request_id]
                self._unforked.pop(request, None)

    def step(self, emit: Callable[[StepOutputs], None],
             should_cut: Callable[[], bool] | None = None) -> WindowTimings | None:
        """Plans and runs one window; `emit` receives each step's outputs as the step completes (its
        common rows as one `TokenBatch`, `_WindowRows`).

        `should_cut` (where the executor can cut windows): asked between steps; True ends the window
        after the steps launched so far, e.g. because a request arrived that the next window can admit.
        With `arrival_cuts`, a window that computes part of a prompt (or a prompt whose samples fork
        after it) also ends after its first step: the next chunk need not wait for the window's end.

        With overlap (`async_scheduling`), a window's last step is left on the device (`_tail`): the
        next window is planned as if every running row took its token, launched from those tokens on the
        device, and hands that step over once its own first step is queued (`ModelRunner.execute_window`).
        """
        started = time.perf_counter()
        self._fork_ready_requests()
        plan = self.scheduler.schedule()
        if plan is not None:
            plan = self._prepare(plan)
        schedule_s = time.perf_counter() - started
        if plan is None:
            self._busy = False
            self._go_idle()
            return None
        self._note_scheduled(plan)
        rows = _WindowRows(plan.sampling_rows, self._pending_release)
        cuts = _Cuts(self.config.arrival_cuts and not all(row.samples for row in plan.rows), should_cut)
        timings = self._execute(plan, partial(self._take_step, plan, rows, emit), cuts)
        self._complete(plan, rows, timings, schedule_s, cuts.cut)
        return timings

    def _fork_ready_requests(self) -> None:
        for request in list(self._unforked):
            try:
                self.scheduler.fork_ready_requests([request])
            except Exception:
                self.fail_request(request.request_id, "forking its samples")
            if request.forked:
                self._unforked.pop(request, None)

    def _note_scheduled(self, plan: WindowPlan) -> None:
        """Queue times of the rows scheduled for the first time, and the window's step-1 tokens."""
        now = time.monotonic()
        for row in plan.rows:
            if row.seq.first_scheduled_time is None:
                row.seq.first_scheduled_time = now
                if row.seq.index == 0:  # forked samples inherit the request's wait
                    self.stats.queue_times_s.append(now - row.seq.request.arrival_time)
        self.stats.first_step_tokens.append(sum(row.num_new_tokens for row in plan.rows))

    def _execute(self, plan: WindowPlan, on_step: Callable[[StepOutput], None], cuts: "_Cuts") -> WindowTimings:
        """Runs the window on the executor, handing the previous window's tail to it and keeping its own
        when this window may leave one."""
        tail, self._tail = self._tail, None
        defer = self._overlap and not any(row.seq.request.needs_host_tokens for row in plan.rows)
        self.stats.num_overlapped_windows += defer
        self._in_flight = plan
        try:
            return self.executor.execute_window(plan, on_step, continuing=self._busy,
                                                should_cut=cuts.ask if cuts.active else None,
                                                tail=tail, defer_tail=defer)
        finally:
            self._in_flight = None

    def _take_step(self, plan: WindowPlan, rows: "_WindowRows", emit: Callable[[StepOutputs], None],
                   step: StepOutput) -> None:
        """A step's outputs as they reach the host: the prompt logprobs step 1 computed, or a token per
        sampling row (most rows as one `TokenBatch`; finishes, logprobs and first tokens one by one)."""
        if step.prompt_logprobs is not None:
            for index, chunk in step.prompt_logprobs.items():
                request = plan.rows[index].seq.request
                try:
                    chunk.extend(request)
                except Exception:
                    self.fail_request(request.request_id, "taking its prompt logprobs")
            return
        if self._unhashed:
            self._hash_blocks()
        tokens = list(step.tokens)  # the runner's list is also its guide's input: not changed here
        outputs = []
        for i in rows.per_row_now(step.finish):
            token, seq = tokens[i], rows.seqs[i]
            tokens[i] = -1  # out of the batch
            if token < 0 or seq.is_finished:  # done at an earlier step, or stopped or aborted since
                continue
            try:
                outputs.append(self._append_token(seq, token, step, i))
            except Exception:
                self.fail_request(seq.request.request_id, "taking its sampled token")
        batch = rows.append_batch(tokens)
        self.stats.num_generated_tokens += len(outputs) + (len(tokens) - tokens.count(-1))
        self.stats.step_batch_sizes.append(len(tokens))
        if step.step > 1:  # (a window's first is in first_step_tokens; under overlap it may come a window late)
            self.stats.later_step_batches.append(len(tokens))
        emit(StepOutputs(outputs, time.monotonic(), batch))

    def _complete(self, plan: WindowPlan, rows: "_WindowRows", timings: WindowTimings, schedule_s: float,
                  cut: bool) -> None:
        """The scheduler's and the statistics' side of a window that ran (its tail counted as taken)."""
        update_start = time.perf_counter()
        accepted = rows.accepted()
        executed = timings.num_steps
        if timings.tail is not None:
            self._tail = timings.tail.hold(plan.sampling_rows, accepted, executed)
        stats = self.stats
        stats.num_cut_windows += cut
        unhashed = self._unhashed if self._tail is not None else None  # the next window's launch comes first
        stats.num_wasted_tokens += self.scheduler.complete_rows(plan.rows, _per_row(plan.rows, accepted), executed,
                                                                unhashed)
        self._release_finished()
        self._busy = self.scheduler.has_work()  # the next window follows at once: its wait is a gap
        stats.num_windows += 1
        stats.num_steps += executed
        stats.window_steps.append(plan.num_steps)
        stats.num_prompt_tokens_computed += sum(r.num_new_tokens for r in plan.rows if r.num_new_tokens > 1)
        stats.schedule_s += schedule_s
        stats.record_timings(timings)
        if self.config.is_adaptive:
            for timed in timings.steps:
                self.scheduler.observe_costs(timed.gap_s if timed.tag.step == 1 else None,
                                             timed.forward_s if timed.tag.phase == "decode" else None)
        stats.update_s += time.perf_counter() - update_start
        if not self._busy:
            self._go_idle()

    def _go_idle(self) -> None:
        """No window follows now: the last window's tail is handed over, and the device timings of its last
        steps, which its own harvest found running, are taken (`CoreStats.idle_steps`), not left for the
        next window's harvest, whenever traffic comes back."""
        self._deliver_tail()
        self.executor.on_idle()
        late = self.executor.idle_timings()
        if late:
            self.stats.record_timings(WindowTimings(steps=late))
            self.stats.idle_steps.extend(late)

    def _deliver_tail(self) -> None:
        """Hands the last window's last step over now: no window follows to overlap it."""
        tail, self._tail = self._tail, None
        if tail is not None:
            tail.deliver()
            self._release_finished()

    def _hash_blocks(self) -> None:
        """What `_complete` left for after the next launch, run by the tail's delivery (`_take_step`). One
        released or preempted before registers then (`_release_finished`, `Scheduler._preempt`)."""
        unhashed, self._unhashed = self._unhashed, []
        for seq in unhashed:
            self.blocks.register_computed_blocks(seq)

    def _prepare(self, plan: WindowPlan) -> WindowPlan | None:
        """Prepares the sequences new to windows (`Executor.prepare`, once per sequence). A request whose
        preparation fails is failed and leaves the plan; the window runs the other rows. (A block copy
        into a failed row's fresh block still runs: the block is free and nothing reads it.)"""
        failed = False
        for row in plan.rows:
            seq = row.seq
            if seq.prepared or seq.is_finished:
                continue
            try:
                self.executor.prepare(row)
                seq.prepared = True
            except Exception:
                failed = True
                self.fail_request(seq.request.request_id, "preparing its window inputs")
        if not failed:
            return plan
        plan.rows = [row for row in plan.rows if not row.seq.is_finished]
        return plan if plan.rows else None

    def take_stats(self) -> CoreStats:
        """The core's statistics as a snapshot; the per-step samples in it are not kept here after."""
        return self.stats.take()

    def _append_token(self, seq: Sequence, token: int, step: StepOutput, i: int) -> SequenceOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        logprobs = None
        if step.logprobs is not None and seq.request.params.logprobs is not None:
            k = seq.request.params.logprobs
            top = list(zip(step.top_ids[i][:k], step.top_logprobs[i][:k])) if step.top_ids is not None else []
            entry = TokenLogprobs(token, step.logprobs[i], step.ranks[i], top)
            seq.logprobs.append(entry)
            logprobs = [entry]
        finish, stop_reason = None, None
        code = step.finish[i]
        if code == FINISH_STOP:
            finish = "stop"
            stop_reason = token if token in seq.request.params.stop_token_ids else None  # None: EOS
            seq.stop_reason = stop_reason
            self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif code == FINISH_LENGTH:
            finish = "length"
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        # A sample's first token carries the request's prompt logprobs, all computed by then.
        prompt = seq.request.prompt_logprobs if seq.request.params.prompt_logprobs is not None and \
            len(seq.token_ids) == seq.prompt_len + 1 else None
        return SequenceOutput(seq.request.request_id, seq.index, [token], logprobs, finish, stop_reason,
                              seq.request.num_cached_tokens, scheduled_at=seq.first_scheduled_time,
                              prompt_logprobs=prompt)


_window_ids = itertools.count(1)  # `TokenBatch.window`: which window's columns a batch carries


class _Cuts:
    """Whether a window ends before its planned steps: after its first step when it computes part of a
    prompt (`prompt_left`: the next chunk need not wait), or when the core loop says so (`should_cut`:
    a request arrived that the next window can admit). `cut` says whether it did."""

    def __init__(self, prompt_left: bool, should_cut: Callable[[], bool] | None):
        self.prompt_left = prompt_left
        self.should_cut = should_cut
        self.active = prompt_left or should_cut is not None
        self.cut = False

    def ask(self) -> bool:
        self.cut = self.prompt_left or self.should_cut is not None and self.should_cut()
        return self.cut


class _WindowRows:
    """A window's sampling rows for its steps' outputs. Most rows of a decode step need only their token
    appended and sent; those go out as one `TokenBatch`, whose columns other than the tokens are built
    here once per window. The others (`per_row_now`) take `EngineCore._append_token`, one by one."""

    def __init__(self, sampling: list[ScheduledSeq], finished: list[Sequence]):
        self.window = next(_window_ids)
        self.seqs = seqs = [row.seq for row in sampling]
        self._appends = [seq.token_ids.append for seq in seqs]
        # A token pending from the previous window's tail arrives during this one: not this window's.
        self._start_lens = [len(seq.token_ids) + seq.num_pending for seq in seqs]
        self._columns = ([seq.request.request_id for seq in seqs], [seq.index for seq in seqs],
                         [seq.request.num_cached_tokens for seq in seqs], [seq.first_scheduled_time for seq in seqs])
        # Logprobs, or a first token (its time; the request's prompt logprobs go with it): every step.
        self._always = [i for i, seq in enumerate(seqs) if seq.request.params.logprobs is not None
                        or seq.first_token_time is None or len(seq.token_ids) == seq.prompt_len]
        # The core's finished sequences grow while a window is in flight (they are released after it):
        # a row whose sequence is among them sends nothing more.
        self._finished, self._num_seen = finished, len(finished)
        self._row_of = {seq: i for i, seq in enumerate(seqs)}
        self._done = [i for i, seq in enumerate(seqs) if seq.is_finished]

    def per_row_now(self, finish: list[int] | None) -> list[int]:
        """The rows this step that take the per-row path: those of `_always` and those that finish."""
        if not finish or not any(finish):
            return self._always
        return sorted({*self._always, *(i for i, code in enumerate(finish) if code)})

    def append_batch(self, tokens: list[int]) -> TokenBatch | None:
        """Appends the tokens of the rows still running (-1: none) and returns them as the step's batch."""
        self._take_finished()
        for i in self._done:
            tokens[i] = -1
        for append, token in zip(self._appends, tokens):
            if token >= 0:
                append(token)
        return TokenBatch(*self._columns, tokens, self.window) if tokens.count(-1) < len(tokens) else None

    def _take_finished(self) -> None:
        finished = self._finished
        for seq in finished[self._num_seen:]:
            i = self._row_of.get(seq)
            if i is not None:
                self._done.append(i)
        self._num_seen = len(finished)

    def accepted(self) -> list[int]:
        """Tokens each row took this window (0 for a row whose earlier pending token never came: it was
        stopped or aborted before that window's tail was delivered)."""
        return [max(len(seq.token_ids) - n, 0) for seq, n in zip(self.seqs, self._start_lens)]


def _per_row(rows: list[ScheduledSeq], accepted: list[int]) -> list[int]:
    """Tokens accepted per plan row, from those per sampling row (the plan's rows that sample, in order)."""
    if len(accepted) == len(rows):
        return accepted
    by_sampling_row = iter(accepted)
    return [next(by_sampling_row) if row.samples else 0 for row in rows]
