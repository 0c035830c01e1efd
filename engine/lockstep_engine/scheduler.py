"""`Scheduler`: continuous batching in multi-step windows. Plain Python, no torch.

Each call to `schedule()` plans one window: a batch whose first step may carry prefill chunks
(chunked prefill) next to decodes, and whose sampling rows then decode `num_steps` tokens without
coming back here. Every KV slot the window may write is reserved beforehand (lookahead), so the
device never needs the host mid-window. Order is first-come first-served, longest output first
(under lof a request that has waited `lof_max_wait_s` goes ahead of longer ones, so short requests are
not starved) or vLLM's priority (the request's `priority`, lower first, then arrival), as
`scheduling_policy` says; when blocks run out the latest admitted (under priority: the last in
priority order) is preempted and later recomputed (its computed blocks stay in the prefix cache). With `num_scheduler_steps="auto"` the window length follows
the load and the measured costs of a step and of a window boundary (`observe_costs`).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from lockstep_engine.adapter_slots import AdapterSlots
from lockstep_engine.block_manager import BlockManager
from lockstep_engine.config import AUTO, SpeculativeConfig
from lockstep_engine.sequence import Request, Sequence, SequenceStatus

AUTO_MIN_STEPS = 1
AUTO_MAX_STEPS = 32
AUTO_START_STEPS = 4
AUTO_WAITING_STEPS = 2  # with requests waiting, before any step was measured
# With requests waiting, auto windows are as short as they can be while the device's idle time at a
# window boundary stays at most this share of the window's decode time.
AUTO_BOUNDARY_SHARE = 0.05
AUTO_COST_SAMPLES = 32  # costs are the median of the last this many measurements (robust to warm-up outliers)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed in the window's first step
    samples: bool  # reaches its compute target in step 1, then decodes
    max_steps: int  # tokens it may sample in this window (0 when it does not sample)
    start_computed: int  # num_computed when the window was planned
    # Tokens it may still sample before max_tokens / max_model_len end it, as planned (0 when it does
    # not sample): computed here once, so the window's inputs and the workers need no per-row property.
    remaining_tokens: int


@dataclass
class WindowPlan:
    rows: list[ScheduledSeq]
    num_steps: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    speculation: SpeculativeConfig | None = None  # its steps speculate; None: one token per row and step
    # LoRA adapters to put in the model's weight slots before the window runs: (slot, name, path)
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def sampling_rows(self) -> list[ScheduledSeq]:
        return [row for row in self.rows if row.samples]


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_scheduler_steps: int | str
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs", "lof" (longest remaining max_tokens first) or "priority"
    lof_max_wait_s: float = 2.0  # under lof, a sequence waiting longer goes ahead of fresh ones, by arrival
    # A prompt with more than this many tokens left to compute is long: it computes at most this many
    # per step (vLLM V1's cap), so the rows decoding next to it wait one bounded step for each chunk.
    # 0: no cap (the step budget alone chunks).
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1  # long prompts partly computed at once; the next waits its turn
    # Speculation (`config.SpeculativeConfig`, None: off): each step may take up to K + 1 tokens per row (K
    # drafts and the bonus token), and its verify forward writes K + 1 KV slots; the lookahead reserves the
    # window's worst case, and every plan carries it to the runner.
    speculation: SpeculativeConfig | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculation.num_speculative_tokens if self.speculation is not None else 0


def _arrival(seq: Sequence) -> float:
    return seq.request.arrival_time


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return seq.request.params.priority, seq.request.arrival_time


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, clock=time.monotonic,
                 adapters: AdapterSlots | None = None):
        """`clock`: the time `Request.arrival_time` is on (time.monotonic, shared by the API and core
        processes of one host). `adapters`: the LoRA slot table when LoRA is on: a waiting sequence whose
        adapter can get no slot stays waiting while those behind it are admitted."""
        self.limits = limits
        self.blocks = block_manager
        self.adapters = adapters
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        # lof: the fresh waiting sequences by arrival (admitted ones are dropped lazily), and the seq_ids
        # of those that waited past lof_max_wait_s
        self._arrivals: deque[Sequence] = deque()
        self._aged: set[int] = set()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._auto_steps = AUTO_START_STEPS
        self._boundary_s: deque[float] = deque(maxlen=AUTO_COST_SAMPLES)  # idle time at window boundaries
        self._decode_step_s: deque[float] = deque(maxlen=AUTO_COST_SAMPLES)  # decode steps' device time

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        for seq in request.sequences:
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Puts a sequence in the queue at its place under the policy.

        fcfs: last, or a preempted sequence back in arrival order, ahead of anything that came later.
        lof: preempted sequences ahead of fresh ones, then those that waited past lof_max_wait_s (by
        arrival), then the largest remaining max_tokens, then arrival; the queue stays sorted by that
        key (it does not change while a sequence waits: a waiting sequence generates nothing, and one
        that ages is taken out and put back).
        priority: by (priority, arrival), preempted or not, as vLLM's priority queue."""
        if self.limits.scheduling_policy == "priority":
            bisect.insort_right(self.waiting, seq, key=_priority_key)
            return
        if self.limits.scheduling_policy == "lof":
            if not preempted:
                bisect.insort_right(self._arrivals, seq, key=_arrival)
            bisect.insort_right(self.waiting, seq, key=self._lof_key)
            return
        if not preempted:
            self.waiting.append(seq)
            return
        index = 0
        while index < len(self.waiting) and self.waiting[index].request.arrival_time <= seq.request.arrival_time:
            index += 1
        self.waiting.insert(index, seq)

    def _lof_key(self, seq: Sequence) -> tuple:
        if seq.seq_id in self._aged:
            return seq.num_preemptions == 0, 0, seq.request.arrival_time
        return seq.num_preemptions == 0, 1, -seq.remaining_tokens, seq.request.arrival_time

    def _promote_aged(self) -> None:
        """lof: moves sequences that waited longer than lof_max_wait_s ahead of the fresh ones."""
        arrivals = self._arrivals
        deadline = self.clock() - self.limits.lof_max_wait_s
        while arrivals and arrivals[0].request.arrival_time < deadline:
            seq = arrivals.popleft()
            if seq.status is not SequenceStatus.WAITING or seq.num_preemptions:
                continue  # admitted or finished since; a preempted one waits ahead of all fresh ones already
            self.waiting.remove(seq)
            self._aged.add(seq.seq_id)
            bisect.insort_right(self.waiting, seq, key=self._lof_key)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends a sequence (stop, length or abort) and releases its blocks, the full ones it computed
        entering the prefix cache first (`complete_rows` leaves a finished sequence's to here)."""
        seq.status = status
        self._aged.discard(seq.seq_id)
        try:
            self.running.remove(seq)
        except ValueError:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.register_computed_blocks(seq)
        self.blocks.free(seq)
        self._release_slot(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = 0

    # ---- planning ---------------------------------------------------------------------------
    def observe_costs(self, boundary_gap_s: float | None = None, decode_step_s: float | None = None) -> None:
        """Measured costs for `auto`: the device's idle time between two back-to-back windows, and a
        decode step's device time."""
        if boundary_gap_s is not None:
            self._boundary_s.append(boundary_gap_s)
        if decode_step_s is not None:
            self._decode_step_s.append(decode_step_s)

    def _waiting_steps(self) -> int:
        """Window length while requests wait: short, so they get in sooner (time to first token), but
        long enough that the boundary's idle time is at most AUTO_BOUNDARY_SHARE of the window."""
        if not self._boundary_s or not self._decode_step_s:
            return AUTO_WAITING_STEPS
        step = statistics.median(self._decode_step_s)
        if step <= 0:
            return AUTO_MAX_STEPS
        steps = math.ceil(statistics.median(self._boundary_s) / (AUTO_BOUNDARY_SHARE * step))
        return max(AUTO_MIN_STEPS, min(steps, AUTO_MAX_STEPS))

    def _choose_num_steps(self) -> int:
        steps = self.limits.num_scheduler_steps
        if steps != AUTO:
            return steps
        if self.waiting:
            self._auto_steps = self._waiting_steps()
        else:
            self._auto_steps = min(self._auto_steps * 2, AUTO_MAX_STEPS)
        # No step past the end of every running row. Rows that end earlier idle in the window (a
        # decode step's cost hardly depends on its rows) rather than cutting it short: a boundary
        # costs more than a few idle rows.
        bound = max((seq.remaining_tokens for seq in self.running), default=self._auto_steps)
        return max(AUTO_MIN_STEPS, min(self._auto_steps, bound))

    def _plan_row(self, seq: Sequence, budget: int, num_steps: int) -> ScheduledSeq | None:
        # Runs for every running row of every window: a decode row reads a few attributes and builds its row.
        # (`Sequence.compute_target` and `remaining_tokens` are folded in.)
        computed, num_tokens = seq.num_computed, len(seq.token_ids) + seq.num_pending
        if not seq.request.forked:  # n > 1: the shared prompt, minus its last token, without sampling
            todo = seq.request.prompt_len - 1 - computed
            if todo <= 0 or budget <= 0 or todo > budget and not self.limits.enable_chunked_prefill:
                return None
            return ScheduledSeq(seq, min(todo, budget, self._chunk_cap(todo)), False, 0, computed, 0)
        todo = num_tokens - computed
        if todo <= 0 or budget <= 0:
            return None
        if todo > 1:  # a prompt (a decode row's todo is 1)
            budget = min(budget, self._chunk_cap(todo))
        if todo > budget:  # a prefill chunk
            return ScheduledSeq(seq, budget, False, 0, computed, 0) if self.limits.enable_chunked_prefill else None
        remaining = seq.max_num_tokens - num_tokens
        if remaining <= 0 and seq.num_pending:  # its pending token is its last: the window in flight ends it
            return None
        if self.limits.num_speculative_tokens:  # up to K + 1 tokens per step
            num_steps *= self.limits.num_speculative_tokens + 1
        steps = num_steps if remaining >= num_steps else max(remaining, 1)  # most rows: no min/max call
        return ScheduledSeq(seq, todo, True, steps, computed, remaining)

    def _chunk_cap(self, todo: int) -> int:
        """The most tokens a prompt with `todo` left may compute in one step."""
        threshold = self.limits.long_prefill_token_threshold
        return threshold if 0 < threshold < todo and self.limits.enable_chunked_prefill else todo

    def _is_long_prefill(self, seq: Sequence) -> bool:
        """A prompt whose computation the threshold chunks (counted against max_long_partial_prefills)."""
        threshold = self.limits.long_prefill_token_threshold
        target = len(seq.token_ids) if seq.request.forked else seq.request.prompt_len - 1
        return 0 < threshold < target - seq.num_computed and self.limits.enable_chunked_prefill

    def _slots_needed(self, row: ScheduledSeq) -> int:
        # A speculating row's last verify forward writes K slots past its last accepted token.
        extra = row.max_steps - 1 + self.limits.num_speculative_tokens if row.samples else 0
        return row.start_computed + row.num_new_tokens + extra

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.register_computed_blocks(seq)  # any the engine left for later: its recompute may hit them
        self.blocks.free(seq)
        self._release_slot(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, preempted=True)

    def schedule(self) -> WindowPlan | None:
        num_steps = self._choose_num_steps()
        budget = self.limits.max_num_batched_tokens
        rows: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preemptions_before = self.num_preemptions

        # Running sequences first, oldest first (under priority: in priority order); the last are
        # preempted when blocks run out.
        running, plan_row, try_reserve = self.running, self._plan_row, self.blocks.try_reserve
        num_long = 0  # long prompts partly computed (running ones continue whatever their number)
        index = 0
        while index < len(running):
            seq = running[index]
            row = plan_row(seq, budget, num_steps)
            if row is None:
                index += 1
                continue
            if not row.samples and row.num_new_tokens > 1 and self._is_long_prefill(seq):
                num_long += 1
            need = self._slots_needed(row)
            reserved = try_reserve(seq, need)
            while reserved is None and running[-1] is not seq:
                self._preempt(running[-1])
                reserved = try_reserve(seq, need)
            if reserved is None:
                self._preempt(seq)
                continue
            if reserved:
                copies += reserved
            rows.append(row)
            budget -= row.num_new_tokens
            index += 1

        # Then waiting sequences in queue order (first come first served, or longest output first),
        # while budget, seats and blocks last.
        # Not after a preemption: blocks are short, and readmitting at once would only thrash.
        preempted = self.num_preemptions != preemptions_before
        if self._arrivals:
            self._promote_aged()
        adapters = self.adapters
        skipped: list[Sequence] = []  # waiting for a LoRA slot; back at the head of the queue afterwards
        while not preempted and self.waiting and len(self.running) < self.limits.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if adapters is not None and not adapters.can_acquire(seq.request.adapter):
                skipped.append(self.waiting.popleft())
                continue
            if not seq.block_ids:
                self.blocks.allocate_cached_prefix(seq)
                if seq.index == 0 and seq.num_preemptions == 0:
                    seq.request.num_cached_tokens = seq.num_computed
            # A long prompt waits while max_long_partial_prefills others are partly computed, and the
            # queue behind it waits too (its order is kept).
            long = self._is_long_prefill(seq)
            if long and num_long >= self.limits.max_long_partial_prefills:
                break
            row = self._plan_row(seq, budget, num_steps)
            reserved = self.blocks.try_reserve(seq, self._slots_needed(row)) if row is not None else None
            if reserved is None:
                break
            num_long += long
            self.waiting.popleft()
            self._aged.discard(seq.seq_id)
            copies += reserved
            if adapters is not None:
                seq.lora_slot = adapters.acquire(seq.request.adapter)
            seq.status = SequenceStatus.RUNNING
            if self.limits.scheduling_policy == "priority":
                bisect.insort_right(self.running, seq, key=_priority_key)
            else:
                self.running.append(seq)
            rows.append(row)
            budget -= row.num_new_tokens

        if skipped:
            self.waiting.extendleft(reversed(skipped))
        if not rows:
            return None
        loads = [(slot, a.name, a.path) for slot, a in adapters.take_loads()] if adapters is not None else []
        return WindowPlan(rows=rows, num_steps=num_steps, block_copies=copies, speculation=self.limits.speculation,
                          lora_loads=loads)

    # ---- results ----------------------------------------------------------------------------
    def complete_row(self, row: ScheduledSeq, num_sampled: int) -> None:
        """Records that a row fed its step-1 tokens and then `num_sampled - 1` sampled tokens."""
        self.complete_rows([row], [num_sampled], 0)

    def complete_rows(self, rows: list[ScheduledSeq], sampled: list[int], executed: int,
                      unhashed: list[Sequence] | None = None) -> int:
        """`complete_row` for a window's rows (`sampled`: each row's sampled tokens, 0 where it does not
        sample) in one pass: it runs for every row of every window. Returns the tokens wasted: the steps
        of the `executed` that a sampling row whose sequence finished computed after its last token.

        With `unhashed`, a running sequence that filled a block is appended to it instead of entering
        the prefix cache now: the caller hashes its blocks later (`BlockManager.register_computed_blocks`),
        once the next window runs. A finished one registers when it is released (`finish`)."""
        blocks = self.blocks
        size, caching = blocks.block_size, blocks.enable_prefix_caching
        wasted = 0
        for row, num_sampled in zip(rows, sampled):
            seq = row.seq
            computed = row.start_computed + row.num_new_tokens
            if num_sampled:
                computed += num_sampled - 1
            seq.num_computed = computed
            # A row that sampled every step did not finish early: most rows look no further.
            if num_sampled < executed and row.samples and seq.is_finished:
                wasted += executed - num_sampled
            # Only a block the window filled enters the prefix cache: most decode windows fill none.
            if caching and computed >= (seq.num_hashed_blocks + 1) * size and not seq.is_finished:
                if unhashed is None:
                    blocks.register_computed_blocks(seq)
                else:
                    unhashed.append(seq)
        return wasted

    def fork_ready_requests(self, requests: list[Request]) -> None:
        """Splits a request with n > 1 into its n samples once the shared prompt is computed."""
        for request in requests:
            parent = request.sequences[0]
            if request.forked or parent.num_computed < request.prompt_len - 1 or parent.is_finished:
                continue
            request.forked = True
            position = self.running.index(parent) + 1 if parent in self.running else None
            for index in range(1, request.params.n):
                child = Sequence(request=request, token_ids=list(parent.token_ids), index=index)
                child.status = parent.status
                child.first_scheduled_time = parent.first_scheduled_time
                if parent.block_ids:
                    self.blocks.fork(parent, child)
                request.sequences.append(child)
                if position is not None:
                    if self.adapters is not None:  # the parent's adapter slot, which it holds: always there
                        child.lora_slot = self.adapters.acquire(request.adapter)
                    self.running.insert(position, child)
                    position += 1
                else:
                    self._enqueue(child)
