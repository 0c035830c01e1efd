"""`ModelRunner`: runs a multi-step window on the device.

Step 1 of a window computes every row's scheduled tokens (prefill chunks and decodes mixed) and
samples for the rows that reached their target. Steps 2..N run those rows as a decode batch whose
inputs advance on the device: the token sampled at step k is the input of step k+1, positions,
sequence lengths and slots move with it, and a row that stops (EOS, stop token, max_tokens,
max_model_len) writes to the sink slot from then on. Each step's tokens go to the host for
streaming; nothing the next step needs comes back from the host.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from lockstep_engine.attention import AttentionMetadata, make_backend
from lockstep_engine.config import EngineConfig
from lockstep_engine.models.llama import LlamaForCausalLM
from lockstep_engine.parallel import SINGLE, ParallelState, broadcast_from_sampler, pp_isend, pp_recv, pp_send
from lockstep_engine.sampler import SampleOutput, Sampler, SamplingTensors
from lockstep_engine.scheduler import WindowPlan
from lockstep_engine.sources import ModelSource, log
from lockstep_engine.step_inputs import (SamplingCache, first_step_arrays, output_counts,
                                         sampling_arrays, sampling_tensors, to_device)

DEFAULT_CPU_KV_BYTES = 2 << 30


def configure_cpu_threads() -> int:
    """Intra-op threads on the CPU: all cores but one by default (LOCKSTEP_CPU_THREADS overrides).

    OpenMP workers spin while they wait; when another busy process shares the cores (the API
    server, a test client) every small matmul then waits on a descheduled thread, which measured
    30x slower here on 2 cores. Leaving a core free avoids that.
    """
    threads = int(os.environ.get("LOCKSTEP_CPU_THREADS") or max((os.cpu_count() or 2) - 1, 1))
    torch.set_num_threads(threads)
    return threads


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device (expected cpu or auto)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if "float16" == checkpoint_dtype else torch.bfloat16


@dataclass
class StepOutput:
    """One step of a window on the host: a token per sampling row, or -1 where the row was done."""

    step: int
    tokens: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass(frozen=True)
class StepTag:
    """What the runner knows of a forward when it starts it; its timing may be harvested a window later."""

    step: int  # 1-based step of its window; step 1 follows the window boundary
    phase: str  # prefill: a window's first step that computed prompt tokens; decode otherwise
    batch: int  # sampling rows of its window


@dataclass(frozen=True)
class StepTiming:
    """One forward's device time (forward + sample + advance) and the idle time before it."""

    tag: StepTag
    forward_s: float
    gap_s: float | None  # since the previous forward ended; None: the first step after idle


@dataclass
class WindowTimings:
    prepare_s: float = 0.0
    output_s: float = 0.0  # host callbacks (output processing)
    num_steps: int = 0  # forwards this window executed
    # Forwards whose device timing completed since the previous window's harvest, oldest first: mostly
    # this window's, plus earlier ones still running when their own window ended.
    steps: list[StepTiming] = field(default_factory=list)


class Guide(Protocol):
    """Guided decoding for the sampling rows of one window (see lockstep_engine.guided).

    Rows constrained by a grammar need the token of step k before the mask of step k+1 exists, so a
    window with guided rows synchronises with the host once per step; other windows never do.
    """

    def allowed_mask(self) -> torch.Tensor: ...  # [rows, vocab] bool on the device

    def accept(self, tokens: list[int]) -> None: ...  # -1: the row produced nothing this step


GuideFactory = Callable[[list], "Guide | None"]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, state: ParallelState = SINGLE):
        self.config = config
        self.guide_factory: GuideFactory | None = None  # set by the engine when guided decoding is available
        self.model_config = source.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, source.config.dtype)
        self.state = state
        # With pipeline stages a window runs as micro-batches in flight, one per stage by default.
        self.micro_batches = config.pipeline_micro_batches or state.pp_size if state.pp_size > 1 else 1
        if self.device.type == "cpu":
            configure_cpu_threads()
        mc = source.config
        self.backend = make_backend(config.attention_backend, mc.num_attention_heads // state.tp_size,
                                    max(mc.num_key_value_heads // state.tp_size, 1), mc.head_dim,
                                    config.block_size, self.device)
        started = time.monotonic()
        with torch.device(self.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = LlamaForCausalLM(mc, state, self.backend)
            finally:
                torch.set_default_dtype(previous)
        self._load_weights(source)
        log(f"loaded {source.spec} on {self.device} as {str(self.dtype).removeprefix('torch.')} "
            f"in {time.monotonic() - started:.1f}s")
        self.sampler = Sampler()
        self.sampling_cache = SamplingCache(mc.vocab_size, mc.eos_token_ids)
        self.block_size = config.block_size
        self.num_blocks = self._count_kv_blocks()
        if state.tp_size * state.pp_size > 1:
            # Every rank must hold the same block ids: agree on the smallest cache.
            count = torch.tensor([self.num_blocks], dtype=torch.int64,
                                 device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=state.world_group)
            self.num_blocks = int(count.item())
        self._allocate_kv_cache()
        self.clock = StepClock(self.device)
        self.host_ring = HostRing() if self.device.type == "cuda" else None
        self._own_backend = self.backend
        self._backends = {self.backend.name: self.backend}
        self._graphs_by_backend: dict[str, object] = {}
        self.graphs = self._decode_graphs()

    def _decode_graphs(self):
        """The decode graphs of the current attention backend (None where steps run eagerly)."""
        if (self.device.type != "cuda" or self.config.enforce_eager or self.state.pp_size > 1
                or not getattr(self.backend, "graph_safe", False)):
            return None
        if self.backend.name not in self._graphs_by_backend:
            from lockstep_engine.cuda_graphs import DecodeGraphs

            self._graphs_by_backend[self.backend.name] = DecodeGraphs(self)
        return self._graphs_by_backend[self.backend.name]

    def use_attention_backend(self, name: str) -> None:
        """Runs the loaded model with another attention backend ("auto": the runner's own), on the same
        weights and KV cache: engines sharing this runner compare backends without a second copy of
        the model. Graphs captured with one backend are never replayed with another."""
        name = self._own_backend.name if name == "auto" else name
        if name not in self._backends:
            attn = self.model.attention_layers()[0]
            self._backends[name] = make_backend(name, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                self.block_size, self.device)
        backend = self.backend = self._backends[name]
        for attn in self.model.attention_layers():
            attn.backend = backend
        self.graphs = self._decode_graphs()

    # ---- setup ------------------------------------------------------------------------------
    def _load_weights(self, source: ModelSource) -> None:
        total, step, loaded = source.num_tensors, max(source.num_tensors // 10, 1), 0

        def progress():
            nonlocal loaded
            for index, item in enumerate(source.iter_weights(self.device)):
                if index % step == 0:
                    log(f"loading weights {100 * index // max(total, 1)}%")
                yield item
                loaded += 1

        self.model.load_weights(progress())
        log("loading weights 100%")

    def _kv_bytes_per_block(self) -> int:
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * torch.finfo(self.dtype).bits // 8
        return per_token * self.block_size * len(self.model.attention_layers())

    def _count_kv_blocks(self) -> int:
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        per_block = self._kv_bytes_per_block()
        if self.device.type == "cpu":
            return max((self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES) // per_block, 1)
        if self.config.kv_cache_memory_bytes:
            return max(self.config.kv_cache_memory_bytes // per_block, 1)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._profile_peak_bytes()
        budget = total * self.config.gpu_memory_utilization - (total - free) - peak
        if budget < per_block:
            raise RuntimeError(f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no room for "
                               f"the KV cache (weights and activations need {(total - free + peak) / 2**30:.1f} GiB)")
        return int(budget // per_block)

    def _profile_peak_bytes(self) -> int:
        """Peak activation memory of the largest step a window can run (prefill budget + sampling)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tokens = min(self.config.max_num_batched_tokens or 2048, 8192)
        rows = min(self.config.max_num_seqs, tokens)
        hidden = torch.zeros(tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        if self.model.lm_head is not None:
            logits = self.model.compute_logits(hidden[:rows]).float()
            torch.softmax(logits, dim=-1).sort(dim=-1)
            del logits
        del hidden
        # MLP intermediate of a full prefill step
        extra = tokens * self.model_config.intermediate_size * 3 * torch.finfo(self.dtype).bits // 8
        peak = torch.cuda.max_memory_allocated(self.device) - before + extra
        torch.cuda.empty_cache()
        return peak

    def _allocate_kv_cache(self) -> None:
        shape = (self.num_blocks + 1, self.block_size)  # + sink block
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(*shape, attn.num_kv_heads, attn.head_dim, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        self.sink_slot = self.num_blocks * self.block_size
        log(f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
            f"({self.num_blocks * self._kv_bytes_per_block() / 2**30:.2f} GiB)")

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for attn in self.model.attention_layers():
            attn.k_cache[dst] = attn.k_cache[src]
            attn.v_cache[dst] = attn.v_cache[src]

    # ---- a window ---------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sends: list | None = None):
        """This stage's layers; hidden states come from the previous stage and go to the next
        (asynchronously when `sends` collects the pending sends). Returns the final hidden states on
        the last stage, None elsewhere."""
        state = self.state
        hidden = None
        if not state.is_first_stage:
            hidden = pp_recv((input_ids.shape[0], self.model_config.hidden_size), self.dtype, self.device, state)
        hidden = self.model(input_ids, positions, meta, hidden)
        if not state.is_last_stage:
            if sends is None:
                pp_send(hidden, state)
            else:
                sends.append(pp_isend(hidden, state))
            return None
        return hidden

    def _sample(self, hidden, t: SamplingTensors, num_generated, counts, guide) -> SampleOutput:
        """Samples on the last stage; with pipeline stages every rank then adopts its tokens."""
        out = self._sample_local(hidden, t, num_generated, counts, guide) if hidden is not None else None
        return self._share_samples(out, t, num_generated.shape[0])

    def _sample_local(self, hidden, t: SamplingTensors, num_generated, counts, guide) -> SampleOutput:
        logits = self.model.compute_logits(hidden).float()
        return self.sampler(logits, t, num_generated, counts, guide.allowed_mask() if guide else None)

    def _share_samples(self, out: SampleOutput | None, t: SamplingTensors, rows: int) -> SampleOutput:
        """With pipeline stages the last stage's samples go to every rank (`out` is None elsewhere)."""
        if out is None:
            out = SampleOutput(tokens=torch.empty(rows, dtype=torch.int64, device=self.device))
            if t.num_logprobs >= 0:
                out.logprobs = torch.empty(rows, dtype=torch.float32, device=self.device)
                out.ranks = torch.empty(rows, dtype=torch.int64, device=self.device)
                if t.num_logprobs > 0:
                    out.top_logprobs = torch.empty(rows, t.num_logprobs, dtype=torch.float32, device=self.device)
                    out.top_ids = torch.empty(rows, t.num_logprobs, dtype=torch.int64, device=self.device)
        if self.state.pp_size > 1:
            tensors = [out.tokens] + ([out.logprobs, out.ranks] if out.logprobs is not None else []) + \
                ([out.top_logprobs, out.top_ids] if out.top_ids is not None else [])
            broadcast_from_sampler(tensors, self.state)
        return out

    def _make_guide(self, rows) -> "Guide | None":
        """The window's grammar masks, on the ranks that sample (every rank of the last stage)."""
        if not has_guided_rows(rows) or not self.state.is_last_stage:
            return None
        if self.guide_factory is None:
            raise ValueError("response_format: guided decoding is not available in this engine")
        return self.guide_factory(rows)

    def _first_step(self, rows) -> "FirstStep":
        """Step 1 of a window: every row's scheduled tokens, flattened, and its sampling rows."""
        host = first_step_arrays(rows, self.block_size, self.num_blocks)
        sampling_rows = [row for row in rows if row.samples]
        sampling = sampling_arrays(sampling_rows, self.sampling_cache) if sampling_rows else None
        views = to_device(host | sampling.arrays if sampling else host, self.device)
        vocab = self.model_config.vocab_size
        t = counts = None
        if sampling is not None:
            t = sampling_tensors(sampling, views, len(sampling_rows), vocab, self.device)
            if sampling.penalties:
                counts = output_counts(views, len(sampling_rows), vocab, self.device)
        decode_only = host["input_ids"].size == len(rows)
        seq_lens = host["seq_lens"]
        meta = AttentionMetadata(
            slot_mapping=views["slots"], block_tables=views["block_table"], seq_lens=views["seq_lens"],
            query_start_loc=None if decode_only else views["query_start"],
            query_start_loc_host=host["query_start"].tolist(), seq_lens_host=seq_lens.tolist(),
            max_seq_len=int(seq_lens.max()))
        return FirstStep(
            input_ids=views["input_ids"], positions=views["positions"], meta=meta, block_table=views["block_table"],
            seq_lens=views["seq_lens"], sample_index=views["sample_index"], sample_sel=views["sample_sel"],
            sampling_rows=sampling_rows, sampling=t, counts=counts, num_generated=views["num_generated"],
            max_steps=views["max_steps"], max_dec_len=int(seq_lens[host["sample_sel"]].max(initial=0)))

    def _decode_state(self, first: "FirstStep", out: SampleOutput) -> "DecodeState":
        """Device state of the decode steps after step 1, with step 1's samples fed back."""
        sel = first.sample_sel
        state = DecodeState(
            tokens=out.tokens, positions=first.seq_lens[sel], table=first.block_table[sel],
            done=torch.zeros(len(first.sampling_rows), dtype=torch.bool, device=self.device),
            steps_done=torch.zeros(len(first.sampling_rows), dtype=torch.int64, device=self.device),
            max_steps=first.max_steps, num_generated=first.num_generated, sampling=first.sampling,
            counts=first.counts)
        self._advance(state, out)
        return state

    @torch.inference_mode()
    def execute_window(self, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                       continuing: bool = False) -> WindowTimings:
        if self.micro_batches > 1 and len(plan.rows) > 1:
            return self._execute_pipelined(plan, on_step, continuing)
        timings = WindowTimings()
        started = time.perf_counter()
        self.copy_blocks(plan.block_copies)
        first = self._first_step(plan.rows)
        sampling_rows = first.sampling_rows
        timings.prepare_s = time.perf_counter() - started

        clock, rows_n = self.clock, len(sampling_rows)
        clock.begin_window(continuing)
        graph = self._decode_window_graph(plan, first)
        if graph is not None:
            return self._replay_window(graph, plan.num_steps, rows_n, on_step, timings)
        clock.start(StepTag(1, first_step_phase(plan), rows_n))
        hidden = self._forward(first.input_ids, first.positions, first.meta)
        if not sampling_rows:
            clock.end()
            timings.num_steps = 1
            timings.steps = clock.harvest()  # without a sync this forward is harvested by a later window
            return timings
        guide = self._make_guide(sampling_rows)
        out = self._sample(hidden[first.sample_index] if hidden is not None else None, first.sampling,
                           first.num_generated, first.counts, guide)
        state = self._decode_state(first, out)
        clock.end()
        timings.num_steps = 1
        table_len = state.table.shape[1] * self.block_size
        # Without a host consumer per step (guided rows, or the CPU where copies are free) the
        # whole window is launched without waiting; tokens reach the host as each step's copy lands.
        # The choice depends on the plan only, so every rank of a group loops alike.
        stream_async = self.device.type == "cuda" and not has_guided_rows(sampling_rows)
        outputs = StepStream(on_step, timings, self.host_ring)
        outputs.push(1, state.emitted, out, sync=not stream_async)
        if guide is not None:
            guide.accept(outputs.last_tokens)
        graph = None
        if self.graphs is not None and plan.num_steps > 1 and self.graphs.usable(state, guide):
            graph = self.graphs.begin(state)
        for step in range(2, plan.num_steps + 1):
            if not stream_async and bool(state.done.all()):
                break
            clock.start(StepTag(step, "decode", rows_n))
            if graph is not None:
                graph.graph.replay()
                emitted, out = graph.inputs["emitted"][:rows_n], None
            else:
                out = self._decode_step(state, min(first.max_dec_len + step - 1, table_len), guide)
                self._advance(state, out)
                emitted = state.emitted
            clock.end()
            timings.num_steps = step
            outputs.push(step, emitted, out, sync=not stream_async)
            if guide is not None:
                guide.accept(outputs.last_tokens)
        outputs.drain()
        timings.steps = clock.harvest()
        return timings

    def _decode_window_graph(self, plan: WindowPlan, first: "FirstStep"):
        """The graph that runs every step of a window, its first included, when the window is decode
        rows only: one new token per row, every row sampling, nothing that needs the host per step.
        Step 1 of such a window is the decode step the graph holds, from the rows' last tokens."""
        rows = plan.rows
        if (self.graphs is None or len(first.sampling_rows) != len(rows) or first.input_ids.shape[0] != len(rows)
                or has_guided_rows(rows)):
            return None
        n = len(rows)
        state = DecodeState(
            tokens=first.input_ids, positions=first.positions, table=first.block_table,
            done=torch.zeros(n, dtype=torch.bool, device=self.device),
            steps_done=torch.zeros(n, dtype=torch.int64, device=self.device),
            max_steps=first.max_steps, num_generated=first.num_generated, sampling=first.sampling,
            counts=first.counts)
        if not self.graphs.usable(state, None):
            return None
        return self.graphs.begin(state)

    def _replay_window(self, graph, num_steps: int, rows_n: int, on_step: Callable[[StepOutput], None],
                       timings: WindowTimings) -> WindowTimings:
        """All steps of a decode-only window as graph replays; tokens stream as each step's copy lands."""
        clock = self.clock
        outputs = StepStream(on_step, timings, self.host_ring)
        emitted = graph.inputs["emitted"][:rows_n]
        for step in range(1, num_steps + 1):
            clock.start(StepTag(step, "decode", rows_n))
            graph.graph.replay()
            clock.end()
            timings.num_steps = step
            outputs.push(step, emitted, None, sync=self.host_ring is None)
        outputs.drain()
        timings.steps = clock.harvest()
        return timings

    def _execute_pipelined(self, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                           continuing: bool) -> WindowTimings:
        """A window split into one micro-batch per pipeline stage, each running its own multi-step
        window, interleaved so the stages work at once: while the last stage computes micro-batch
        m at step k, the first stage computes micro-batch m+1. Hidden states go to the next stage
        with asynchronous sends; a stage other than the last takes in micro-batch m's samples (a
        broadcast from the last stage) only just before it needs them, at step k+1. Every rank walks
        the same (step, micro-batch) order, so the broadcasts pair up without extra messages."""
        timings = WindowTimings()
        started = time.perf_counter()
        self.copy_blocks(plan.block_copies)
        parts = split_micro_batches(plan.rows, self.micro_batches, plan.num_steps)
        batches = [MicroBatch(self._first_step(rows)) for rows in parts]
        merger = StepMerger(on_step, [len(b.first.sampling_rows) for b in batches])
        # The host needs each step's tokens before the next (guided rows; early exit on the CPU).
        sync = self.device.type != "cuda" or has_guided_rows(plan.rows)
        for index, batch in enumerate(batches):
            batch.guide = self._make_guide(batch.first.sampling_rows)
            batch.stream = StepStream(lambda out, index=index: merger.add(out.step, index, out), timings,
                                      self.host_ring)
            batch.table_len = batch.first.block_table.shape[1] * self.block_size
        timings.prepare_s = time.perf_counter() - started

        clock, rows_n = self.clock, len(plan.sampling_rows)
        clock.begin_window(continuing)
        sends: list = []
        last_stage = self.state.is_last_stage
        for step in range(1, plan.num_steps + 1):
            clock.start(StepTag(step, first_step_phase(plan) if step == 1 else "decode", rows_n))
            idle = []
            for index, batch in enumerate(batches):
                if batch.awaiting is not None:  # this stage's deferred intake of step - 1
                    self._take_samples(batch, sync)
                if batch.finished:
                    idle.append(index)
                    continue
                batch.awaiting = (step, self._micro_forward(batch, step, sends))
                if not batch.first.sampling_rows:  # prefill chunks only: nothing to sample
                    batch.awaiting, batch.finished = None, True
                elif last_stage:
                    self._take_samples(batch, sync)
            if len(idle) == len(batches):  # every row stopped: the window ends early on every rank
                clock.drop_start()
                break
            clock.end()
            timings.num_steps = step
            for index in idle:
                merger.add(step, index, None)
        for batch in batches:
            if batch.awaiting is not None:
                self._take_samples(batch, sync)
            batch.stream.drain()
        for work, _ in sends:
            work.wait()
        timings.steps = clock.harvest()
        return timings

    def _micro_forward(self, batch: "MicroBatch", step: int, sends: list) -> SampleOutput | None:
        """This stage's share of one micro-batch step; the samples on the last stage, else None."""
        first = batch.first
        if step == 1:
            hidden = self._forward(first.input_ids, first.positions, first.meta, sends)
            if hidden is None or not first.sampling_rows:
                return None
            hidden = hidden[first.sample_index]
            return self._sample_local(hidden, first.sampling, first.num_generated, first.counts, batch.guide)
        state = batch.state
        meta = self._decode_meta(state, min(first.max_dec_len + step - 1, batch.table_len))
        hidden = self._forward(state.tokens, state.positions, meta, sends)
        if hidden is None:
            return None
        return self._sample_local(hidden, state.sampling, state.num_generated, state.counts, batch.guide)

    def _take_samples(self, batch: "MicroBatch", sync: bool) -> None:
        """Adopts the last stage's samples of the micro-batch's pending step and feeds them back."""
        step, out = batch.awaiting
        batch.awaiting = None
        first = batch.first
        sampling = batch.state.sampling if batch.state is not None else first.sampling
        out = self._share_samples(out, sampling, len(first.sampling_rows))
        if step == 1:
            batch.state = self._decode_state(first, out)
        else:
            batch.state.positions = batch.state.positions + (~batch.state.done).long()
            self._advance(batch.state, out)
        batch.stream.push(step, batch.state.emitted, out, sync=sync)
        if batch.guide is not None:
            batch.guide.accept(batch.stream.last_tokens)
        if sync:
            batch.finished = bool(batch.state.done.all())

    def _decode_meta(self, state: "DecodeState", max_seq_len: int) -> AttentionMetadata:
        bs = self.block_size
        # Done rows may point past their reservation: clamp, then send them to the sink.
        block_index = (state.positions // bs).clamp(max=state.table.shape[1] - 1)
        slot = state.table.gather(1, block_index.unsqueeze(1)).squeeze(1) * bs + state.positions % bs
        slot = torch.where(state.done, self.sink_slot, slot)
        return AttentionMetadata(slot_mapping=slot, block_tables=state.table, seq_lens=state.positions + 1,
                                 query_start_loc=None, max_seq_len=max_seq_len)

    def _decode_step(self, state: "DecodeState", max_seq_len: int, guide) -> "SampleOutput":
        """One decode step of every sampling row: forward, then sample. Inputs come from the device."""
        hidden = self._forward(state.tokens, state.positions, self._decode_meta(state, max_seq_len))
        out = self._sample(hidden, state.sampling, state.num_generated, state.counts, guide)
        state.positions = state.positions + (~state.done).long()
        return out

    @staticmethod
    def _advance(state: "DecodeState", out) -> None:
        """Feeds a step's samples back: valid rows take the token, stops and limits end rows."""
        valid = ~state.done
        state.tokens = torch.where(valid, out.tokens, state.tokens)
        state.emitted = torch.where(valid, state.tokens, -1)
        hit_stop = (state.sampling.stop_ids == state.tokens.unsqueeze(1)).any(dim=1) & valid
        state.steps_done = state.steps_done + valid.long()
        if state.counts is not None:
            state.counts.scatter_add_(1, state.tokens.unsqueeze(1), valid.float().unsqueeze(1))
        state.num_generated = state.num_generated + valid.long()
        state.done = state.done | hit_stop | (state.steps_done >= state.max_steps)


@dataclass
class DecodeState:
    """Device tensors of the sampling rows inside a window, [rows] unless noted."""

    tokens: torch.Tensor  # last sampled token: the next step's input
    positions: torch.Tensor  # position of that token
    table: torch.Tensor  # [rows, max_blocks] block table
    done: torch.Tensor  # bool: stopped or out of budget; writes go to the sink slot
    steps_done: torch.Tensor
    max_steps: torch.Tensor
    num_generated: torch.Tensor
    sampling: SamplingTensors
    counts: torch.Tensor | None  # [rows, vocab] output token counts (penalties)
    emitted: torch.Tensor | None = None  # this step's token per row, -1 where the row was done


def has_guided_rows(rows) -> bool:
    return any(row.seq.request.params.json_schema is not None for row in rows)


def first_step_phase(plan: WindowPlan) -> str:
    """prefill when the window's first forward computes prompt tokens (as `CoreStats` counts them)."""
    return "prefill" if any(row.num_new_tokens > 1 for row in plan.rows) else "decode"


@dataclass
class FirstStep:
    """Device inputs of a window's first step, and what its sampling rows carry into the next steps."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    block_table: torch.Tensor  # [rows, max_blocks]
    seq_lens: torch.Tensor  # [rows] after step 1
    sample_index: torch.Tensor  # flattened token index of each sampling row's last token
    sample_sel: torch.Tensor  # row index of each sampling row
    sampling_rows: list
    sampling: SamplingTensors | None
    counts: torch.Tensor | None
    num_generated: torch.Tensor  # [sampling rows] output tokens before the window
    max_steps: torch.Tensor  # [sampling rows] tokens each may sample in the window
    max_dec_len: int  # longest sampling row after step 1


@dataclass
class MicroBatch:
    """One pipeline micro-batch of a window: its own first step, decode state, guide and stream."""

    first: FirstStep
    state: DecodeState | None = None
    guide: "Guide | None" = None
    stream: "StepStream | None" = None
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
        if any(p.logprobs is not None for p in parts):
            out.logprobs = [x for p in parts for x in (p.logprobs or [0.0] * len(p.tokens))]
            out.ranks = [x for p in parts for x in (p.ranks or [0] * len(p.tokens))]
        if any(p.top_ids is not None for p in parts):
            out.top_ids = [x for p in parts for x in (p.top_ids or [[]] * len(p.tokens))]
            out.top_logprobs = [x for p in parts for x in (p.top_logprobs or [[]] * len(p.tokens))]
        return out


class HostMark:
    """A host-clock mark with the part of `torch.cuda.Event`'s interface the clock uses: complete once
    recorded, so the CPU runs the same pending/harvest logic as CUDA."""

    __slots__ = ("at",)

    def __init__(self):
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostMark) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event


def cuda_timing_event():
    return torch.cuda.Event(enable_timing=True)


@dataclass
class _Forward:
    """A forward whose marks were recorded but not yet harvested."""

    tag: StepTag
    start: object
    end: object | None  # None while the forward runs on the host side (between start() and end())
    after_previous: bool  # the idle time since the previous forward ended counts as a gap


class StepClock:
    """Times forwards and the idle gaps between them for the runner's lifetime.

    Marks come from a pool made once (CUDA events, recorded on the current stream, or host-clock marks
    on the CPU) and are reused round-robin. `harvest()` never waits: it walks the recorded forwards in
    order and stops at the first whose marks the device has not reached (`query()`); those are harvested
    by a later call. Only when every mark of the pool is pending and unfinished does the clock wait for
    the oldest forward (`num_forced_syncs` counts it; 0 in steady state, where each window harvests its
    own after its outputs reached the host).
    """

    def __init__(self, device: torch.device, pool_size: int = 512, mark_factory: Callable[[], object] | None = None):
        # Pending forwards hold 2 marks each and the last harvested end is kept for the next gap: with 4
        # marks an exhausted pool always holds a completed forward to wait for.
        if pool_size < 4:
            raise ValueError(f"pool_size={pool_size} is too small (expected at least 4)")
        if mark_factory is None:
            mark_factory = cuda_timing_event if device.type == "cuda" else HostMark
        self._free = deque(mark_factory() for _ in range(pool_size))
        self._pending: deque[_Forward] = deque()
        self._previous_end = None  # end mark of the last harvested forward, kept for the next gap
        self._after_previous = False  # whether the next start() follows the previous forward at once
        self._ready: list[StepTiming] = []
        self.num_forced_syncs = 0

    def begin_window(self, continuing: bool) -> None:
        """Before a window's first start(): its idle time since the previous forward is a gap only when
        the window follows the previous one at once; the first step after idle has none."""
        if self._pending and self._pending[-1].end is None:  # a window that raised left its start open
            self.drop_start()
        self._after_previous = continuing

    def start(self, tag: StepTag) -> None:
        mark = self._take()
        mark.record()
        self._pending.append(_Forward(tag, mark, None, self._after_previous))

    def end(self) -> None:
        mark = self._take()
        mark.record()
        self._pending[-1].end = mark
        self._after_previous = True

    def drop_start(self) -> None:
        """Forgets the start just recorded: the step ran nothing."""
        forward = self._pending.pop()
        assert forward.end is None, "drop_start() after end()"
        self._free.append(forward.start)

    def harvest(self) -> list[StepTiming]:
        """Timings of the forwards the device finished since the last harvest, oldest first."""
        self._collect()
        ready, self._ready = self._ready, []
        return ready

    def _take(self):
        if not self._free:
            self._collect()  # harvest fell behind: free what the device has finished, still without waiting
        if not self._free:
            self._wait_oldest()
        return self._free.popleft()

    def _wait_oldest(self) -> None:
        # Every mark is in use, so (pool_size >= 4) the oldest pending forward has both marks recorded.
        self.num_forced_syncs += 1
        oldest = self._pending[0]
        oldest.start.synchronize()
        oldest.end.synchronize()
        self._collect()

    def _collect(self) -> None:
        pending = self._pending
        while pending:
            forward = pending[0]
            if forward.end is None or not forward.end.query() or not forward.start.query():
                return
            pending.popleft()
            previous = self._previous_end
            gap = None
            if previous is not None:
                if forward.after_previous:
                    gap = previous.elapsed_time(forward.start) / 1e3
                self._free.append(previous)
            self._ready.append(StepTiming(forward.tag, forward.start.elapsed_time(forward.end) / 1e3, gap))
            self._free.append(forward.start)
            self._previous_end = forward.end


def pinned_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class HostSlot:
    """Host buffers for one step's outputs, and the event that says their copy landed."""

    __slots__ = ("buffers", "event", "views")

    def __init__(self, event):
        self.event = event
        self.buffers: list[torch.Tensor] = []  # 1-D, one per output tensor, grown to the largest seen
        self.views: list[torch.Tensor] = []  # this step's shapes over the buffers

    def copy_from(self, tensors: list[torch.Tensor], allocate: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        self.views = []
        for i, x in enumerate(tensors):
            if i == len(self.buffers):
                self.buffers.append(allocate(_capacity(x.numel()), x.dtype))
            elif self.buffers[i].dtype != x.dtype or self.buffers[i].numel() < x.numel():
                self.buffers[i] = allocate(_capacity(x.numel()), x.dtype)
            self.views.append(self.buffers[i][:x.numel()].view(x.shape).copy_(x, non_blocking=True))
        self.event.record()

    def values(self) -> list:
        return [x.tolist() for x in self.views]


def _capacity(numel: int) -> int:
    return 1 << max(numel - 1, 0).bit_length()  # a power of two: a growing batch reallocates rarely


class HostRing:
    """Pinned host buffers for the asynchronous step copies, kept for the runner's lifetime. A slot goes
    back to the ring only once its copy landed and was read, so a reused buffer is never still being
    written; the ring grows by a slot when a window has more copies in flight than it holds."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] = pinned_buffer,
                 event_factory: Callable[[], object] | None = None):
        self.allocate = allocate
        self.event_factory = event_factory or torch.cuda.Event
        self._free: deque[HostSlot] = deque()
        self.num_slots = 0

    def acquire(self) -> HostSlot:
        if self._free:
            return self._free.popleft()
        self.num_slots += 1
        return HostSlot(self.event_factory())

    def release(self, slot: HostSlot) -> None:
        self._free.append(slot)


class StepStream:
    """Hands each step's tokens to the host callback: at once (sync) or as its async copy into a slot of
    the runner's `HostRing` lands."""

    def __init__(self, on_step: Callable[[StepOutput], None], timings: WindowTimings, ring: HostRing | None):
        self.on_step = on_step
        self.timings = timings
        self.ring = ring
        self.pending: deque[tuple[int, HostSlot]] = deque()
        self.last_tokens: list[int] = []

    def push(self, step: int, emitted: torch.Tensor, out, sync: bool) -> None:
        tensors = [emitted]
        if out is not None and out.logprobs is not None:
            tensors += [out.logprobs, out.ranks]
            if out.top_ids is not None:
                tensors += [out.top_ids, out.top_logprobs]
        if sync:
            self._deliver(step, [x.tolist() for x in tensors])
            return
        slot = self.ring.acquire()
        slot.copy_from(tensors, self.ring.allocate)
        self.pending.append((step, slot))
        while self.pending and self.pending[0][1].event.query():
            self._deliver_slot(*self.pending.popleft())

    def drain(self) -> None:
        while self.pending:
            step, slot = self.pending.popleft()
            slot.event.synchronize()
            self._deliver_slot(step, slot)

    def _deliver_slot(self, step: int, slot: HostSlot) -> None:
        values = slot.values()
        self.ring.release(slot)
        self._deliver(step, values)

    def _deliver(self, step: int, values: list) -> None:
        out = StepOutput(step=step, tokens=values[0])
        if len(values) > 1:
            out.logprobs, out.ranks = values[1], values[2]
            if len(values) > 3:
                out.top_ids, out.top_logprobs = values[3], values[4]
        self.last_tokens = out.tokens
        started = time.perf_counter()
        self.on_step(out)
        self.timings.output_s += time.perf_counter() - started
