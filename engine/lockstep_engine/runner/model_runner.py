"""`ModelRunner`: one rank's model shard, KV cache and window loops.

Setup (device, dtype, weights, KV sizing and allocation), the attention backend switch, and the
dispatch of a window to its loop: the pipelined loop over micro-batches (`pipelined`), all steps as
graph replays for a window of decode rows only (`cuda_graphs`), or the eager loop here. The steps
themselves are `steps.Steps`. Each step's tokens go to the host for streaming (`host_stream`);
nothing the next step needs comes back from the host.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Callable

import torch

from lockstep_engine.attention_backends import make_backend
from lockstep_engine.config import DEFAULT_BATCHED_TOKENS, EngineConfig
from lockstep_engine.log import log
from lockstep_engine.models.llama import LlamaForCausalLM
from lockstep_engine.parallel import SINGLE, ParallelState, head_weight_in_layers, stage_layers
from lockstep_engine.runner.cuda_graphs import BUCKETS, DecodeGraphs
from lockstep_engine.runner.host_stream import HostRing, StepStream, WindowTail
from lockstep_engine.runner.outputs import Guide, GuideFactory, StepOutput, StepTag, WindowTimings
from lockstep_engine.runner.pipelined import run_pipelined
from lockstep_engine.runner.prefill_graphs import PrefillGraphs
from lockstep_engine.runner.spec_window import SpecGraphs, run_speculative
from lockstep_engine.runner.step_clock import StepClock
from lockstep_engine.runner.steps import Steps
from lockstep_engine.runner.window_state import FirstStep, first_step_phase, has_guided_rows
from lockstep_engine.scheduler import WindowPlan
from lockstep_engine.sources import ModelSource
from lockstep_engine.spec_decode.draft import DraftModel

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
        layers = stage_layers(mc.num_hidden_layers, state.pp_rank, state.pp_size, head_weight_in_layers(mc),
                              config.pipeline_layer_partition)
        started = time.monotonic()
        with torch.device(self.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = LlamaForCausalLM(mc, state, self.backend, layers)
            finally:
                torch.set_default_dtype(previous)
        self._load_weights(source)
        log(f"loaded {source.spec} on {self.device} as {str(self.dtype).removeprefix('torch.')} "
            f"in {time.monotonic() - started:.1f}s")
        # LoRA weight slots before the KV cache is sized, so the cache gets what they leave
        self.lora = self.model.lora = self._make_lora() if config.enable_lora else None
        self._adapters: OrderedDict[tuple[str, str], object] = OrderedDict()  # read adapters (`read_lora`)
        # Draft models by (source, seed), loaded once (`draft_model`); the configured one now, so the KV cache
        # is sized with its weights in memory and its cache's share of every block counted.
        self._drafts: dict[tuple, DraftModel] = {}
        spec = config.speculative_config
        if spec is not None and not spec.is_ngram:
            self._drafts[(spec.model, spec.seed)] = DraftModel(spec, config, mc.vocab_size, self.device, self.dtype)
        self.block_size = config.block_size
        self.num_blocks = self._count_kv_blocks()
        if state.tp_size * state.pp_size > 1:
            # Every rank must hold the same block ids: agree on the smallest cache.
            count = torch.tensor([self.num_blocks], dtype=torch.int64,
                                 device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=state.world_group)
            self.num_blocks = int(count.item())
        self._allocate_kv_cache()
        for draft in self._drafts.values():
            draft.allocate_cache(self.num_blocks)
        self.steps = Steps(self.model, state, self.device, self.dtype, mc.hidden_size, mc.vocab_size,
                           mc.eos_token_ids, self.block_size, self.num_blocks, config.max_model_len)
        self.clock = StepClock(self.device)
        self.host_ring = HostRing() if self.device.type == "cuda" else None
        self._own_backend = self.backend
        self._backends = {self.backend.name: self.backend}
        self._graphs_by_backend: dict[str, DecodeGraphs] = {}
        self.graphs = self._decode_graphs()
        self.prefill_graphs: PrefillGraphs | None = None  # made by use_prefill_graphs (warm-up), when they win
        self._prefill_probe: PrefillGraphs | None = None  # the last ones use_prefill_graphs made, won or not

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The decode graphs of the current attention backend (None where steps run eagerly)."""
        if (self.device.type != "cuda" or self.config.enforce_eager or self.state.pp_size > 1
                or not getattr(self.backend, "graph_safe", False)):
            return None
        if self.backend.name not in self._graphs_by_backend:
            self._graphs_by_backend[self.backend.name] = DecodeGraphs(self.steps)
        return self._graphs_by_backend[self.backend.name]

    def prefill_graphs_possible(self) -> bool:
        """Whether first steps with prompt tokens could be graphed here: CUDA graphs on, one rank (the warm-up
        decides on this rank alone), no LoRA weights, and an attention backend whose prefill is graph-safe."""
        return (self.graphs is not None and self.config.prefill_cuda_graphs != "off" and self.lora is None
                and self.state.tp_size * self.state.pp_size == 1 and getattr(self.backend, "prefill_graph_safe", False))

    def use_prefill_graphs(self, log: Callable[[str], None]) -> int:
        """Decides (prefill_cuda_graphs "auto": by timing one bucket eagerly and as a replay) and captures
        every token bucket's graph; returns how many were captured (0: first steps stay eager)."""
        if not self.prefill_graphs_possible():
            return 0
        graphs = PrefillGraphs(self.steps, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                               self.graphs.pool, self.graphs.capture)
        # Its graphs live as long as the runner, used or not: they are captured into the decode graphs' pool,
        # and a pool whose graphs were all freed while it still holds memory (cuBLAS's workspace) cannot be
        # captured into again (PyTorch asserts `use_count > 0` at the next decode capture).
        self._prefill_probe = graphs
        try:
            if self.config.prefill_cuda_graphs == "auto" and self.device.type == "cuda":
                wins, eager_ms, replay_ms = graphs.launch_bound()
                log(f"prefill graphs: a probe step takes {eager_ms:.2f} ms eagerly and {replay_ms:.2f} ms as a "
                    "replay: " + ("used" if wins else "not used (the eager step is device time)"))
                if not wins:
                    return 0
            count = graphs.capture_all()
        except RuntimeError as error:  # a capture that fails leaves the first steps eager, as before
            log(f"prefill graphs: not used, a capture failed: {error}")
            return 0
        self.prefill_graphs = graphs
        return count

    def _first_forward(self, first: FirstStep):
        """Step 1's forward: one replay of its token bucket's graph where there is one, else eager."""
        graphs = self.prefill_graphs
        if graphs is not None and graphs.usable(first):
            return graphs.forward(first)
        return self.steps.forward(first.input_ids, first.positions, first.meta)

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
        self.prefill_graphs = None  # captured with the previous backend: the first steps run eagerly until chosen again

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

    def _make_lora(self):
        from lockstep_engine.lora.model import ModelLoRA

        config = self.config
        rows = config.max_num_seqs * self.micro_batches
        tokens = (config.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, config.max_num_seqs)) * self.micro_batches
        lora = ModelLoRA(self.model, config.max_loras, config.max_lora_rank, max(tokens + rows, BUCKETS[-1]),
                         self.device, self.dtype)
        log(f"LoRA: {config.max_loras} adapter slot(s) of rank <= {config.max_lora_rank} "
            f"({lora.nbytes / 2**20:.1f} MiB)")
        return lora

    def read_lora(self, name: str, path: str):
        """The adapter at `path` (`lora.adapters.LoRAAdapter`), read and checked against this model once and
        kept for max_cpu_loras adapters; `lora.adapters.AdapterError` names what is wrong with it."""
        from lockstep_engine.lora.adapters import read_adapter

        key = (name, path)
        adapter = self._adapters.get(key)
        if adapter is None:
            adapter = read_adapter(name, path, self.model_config, self.config.max_lora_rank)
            self._adapters[key] = adapter
            while len(self._adapters) > self.config.max_cpu_loras:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(key)
        return adapter

    def forget_lora(self, name: str, path: str) -> None:
        self._adapters.pop((name, path), None)

    def load_loras(self, loads: list[tuple[int, str, str]]) -> None:
        """Puts adapters into the model's weight slots (a window's `lora_loads`), before its first step."""
        for slot, name, path in loads:
            self.lora.load(slot, self.read_lora(name, path))

    def _kv_bytes_per_block(self, drafts: bool = True) -> int:
        """Bytes of one KV block in every layer (and, with `drafts`, in the draft models' caches too)."""
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * torch.finfo(self.dtype).bits // 8
        draft_bytes = sum(draft.kv_bytes_per_block() for draft in self._drafts.values()) if drafts else 0
        return per_token * self.block_size * len(self.model.attention_layers()) + draft_bytes

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
            f"({self.num_blocks * self._kv_bytes_per_block(drafts=False) / 2**30:.2f} GiB)")

    def draft_model(self, spec) -> DraftModel | None:
        """The draft model of a `SpeculativeConfig` (None for n-gram drafting), loaded on first use with a
        KV cache over this runner's blocks."""
        if spec is None or spec.is_ngram:
            return None
        key = (spec.model, spec.seed)
        if key not in self._drafts:
            self._drafts[key] = DraftModel(spec, self.config, self.model_config.vocab_size, self.device, self.dtype,
                                           self.num_blocks)
        return self._drafts[key]

    def spec_graphs(self, spec) -> SpecGraphs | None:
        """The captured speculative steps of the current decode graphs (None: eager: a draft model whose
        attention backend cannot be captured, or a history too large for long contexts at many rows,
        `spec_window.MAX_HISTORY_BYTES`)."""
        if (self.graphs is None or spec is None
                or not SpecGraphs.fits(self.config.max_num_seqs, self.config.max_model_len, spec)):
            return None
        draft = self.draft_model(spec)
        if draft is not None and not draft.graph_safe:
            return None
        if self.graphs.spec is None or self.graphs.spec.spec != spec:
            self.graphs.spec = SpecGraphs(self.graphs, spec, draft, self.config.max_num_seqs)
        return self.graphs.spec

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        layers = self.model.attention_layers()
        for draft in self._drafts.values():
            layers = layers + draft.attention_layers()
        for attn in layers:
            attn.k_cache[dst] = attn.k_cache[src]
            attn.v_cache[dst] = attn.v_cache[src]

    def _make_guide(self, rows) -> Guide | None:
        """The window's grammar masks, on the ranks that sample (every rank of the last stage)."""
        if not has_guided_rows(rows) or not self.state.is_last_stage:
            return None
        if self.guide_factory is None:
            raise ValueError("response_format: guided decoding is not available in this engine")
        return self.guide_factory(rows)

    # ---- a window ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_window(self, plan: WindowPlan, on_step: Callable[[StepOutput], None],
                       continuing: bool = False, should_cut: Callable[[], bool] | None = None,
                       tail: WindowTail | None = None, defer_tail: bool = False) -> WindowTimings:
        """Runs a window's steps; `on_step` gets each step's outputs as they reach the host.

        With `should_cut`, it is asked before each step from the second on, after the outputs of all
        but the last CUT_LAUNCH_AHEAD launched steps were handed over: True ends the window there
        (`timings.num_steps` says how many steps ran). The device keeps a step queued meanwhile.

        Overlap: `tail` is the previous window's last step, not handed over yet; this window's rows
        that continue from it take their tokens from it on the device, and it is delivered (to its own
        window's callback) as soon as this window's first step is queued. With `defer_tail` this window
        leaves its own last step undelivered in `timings.tail` in the same way."""
        started = time.perf_counter()
        if plan.lora_loads:
            self.load_loras(plan.lora_loads)
        self.copy_blocks(plan.block_copies)
        if plan.speculation is not None:
            if tail is not None:
                raise RuntimeError("a window tail cannot be carried into a speculative window")
            return run_speculative(self.steps, plan, self.draft_model(plan.speculation), self.clock, on_step,
                                   continuing, should_cut, started, self.spec_graphs(plan.speculation), self.host_ring)
        if self.micro_batches > 1 and len(plan.rows) > 1:
            if tail is not None:
                raise RuntimeError("a window tail cannot be carried into pipeline micro-batches")
            return run_pipelined(self.steps, self.clock, self.host_ring, self._make_guide, self.micro_batches,
                                 plan, on_step, continuing, started)
        steps = self.steps
        timings = WindowTimings()
        first = steps.first_step(plan.rows, tail)
        sampling_rows = first.sampling_rows
        timings.prepare_s = time.perf_counter() - started

        clock, rows_n = self.clock, len(sampling_rows)
        clock.begin_window(continuing)
        graph = self._decode_window_graph(plan, first)
        if graph is not None:
            return self._replay_window(graph, plan.num_steps, sampling_rows, on_step, timings, should_cut, tail,
                                       defer_tail)
        clock.start(StepTag(1, first_step_phase(plan), rows_n))
        hidden = self._first_forward(first)
        _deliver(tail, timings)
        if first.prompt is not None and hidden is not None:  # before any token of the window
            on_step(StepOutput(1, [], prompt_logprobs=steps.prompt_logprobs(hidden, first)))
        if not sampling_rows:
            clock.end()
            timings.num_steps = 1
            timings.steps = clock.harvest()  # without a sync this forward is harvested by a later window
            return timings
        guide = self._make_guide(sampling_rows)
        out = steps.share_samples(steps.sample_first(hidden, first, guide), first.sampling, rows_n)
        state = steps.decode_state(first, out)
        clock.end()
        timings.num_steps = 1
        table_len = state.table.shape[1] * self.block_size
        # Without a host consumer per step (guided rows, or the CPU where copies are free) the
        # whole window is launched without waiting; tokens reach the host as each step's copy lands.
        # The choice depends on the plan only, so every rank of a group loops alike.
        stream_async = self.host_ring is not None and not has_guided_rows(sampling_rows)
        outputs = StepStream(on_step, timings, self.host_ring, hold=TAIL_STEPS if defer_tail else 0)
        outputs.push(1, state.emitted, out, sync=not stream_async)
        if guide is not None:
            guide.accept(outputs.last_tokens)
        graph = None
        if self.graphs is not None and plan.num_steps > 1 and self.graphs.usable(state, guide):
            graph = self.graphs.begin(state)
        for step in range(2, plan.num_steps + 1):
            if not stream_async and bool(state.done.all()):
                break
            if should_cut is not None and _cut(outputs, should_cut):
                break
            clock.start(StepTag(step, "decode", rows_n))
            if graph is not None:
                graph.graph.replay()
                emitted, out = graph.inputs["emitted"][:, :rows_n], None
            else:
                out = steps.step(state, min(first.max_dec_len + step - 1, table_len), guide)
                emitted = state.emitted
            clock.end()
            timings.num_steps = step
            outputs.push(step, emitted, out, sync=not stream_async)
            if guide is not None:
                guide.accept(outputs.last_tokens)
        # The graph's buffers hold the last step once it replayed one (it loads the tokens, not `emitted`).
        replayed = graph is not None and timings.num_steps > 1
        last = graph.inputs if replayed else {"tokens": state.tokens, "emitted": state.emitted}
        return self._end_window(outputs, timings, sampling_rows, last, defer_tail)

    def _end_window(self, outputs: StepStream, timings: WindowTimings, sampling_rows, last: dict,
                    defer_tail: bool) -> WindowTimings:
        """Hands the window's steps over, all of them or all but the last TAIL_STEPS (`WindowTail`, with
        `last`: the device's tokens and emitted [token, finish] rows after the last step)."""
        rows = len(sampling_rows)
        depth = min(TAIL_STEPS, outputs.undelivered) if defer_tail else 0
        if depth:
            outputs.drain(keep=depth)
            timings.tail = WindowTail(outputs, last["tokens"][:rows], last["emitted"][:, :rows],
                                      [row.seq for row in sampling_rows], depth)
        else:
            outputs.drain()
        timings.steps = self.clock.harvest()
        return timings

    def _decode_window_graph(self, plan: WindowPlan, first: FirstStep):
        """The graph that runs every step of a window, its first included, when the window is decode
        rows only: one new token per row, every row sampling, nothing that needs the host per step.
        Step 1 of such a window is the decode step the graph holds, from the rows' last tokens."""
        rows = plan.rows
        if (self.graphs is None or len(first.sampling_rows) != len(rows) or first.input_ids.shape[0] != len(rows)
                or has_guided_rows(rows)):
            return None
        state = self.steps.decode_window_state(first)
        if not self.graphs.usable(state, None):
            return None
        return self.graphs.begin(state)

    def _replay_window(self, graph, num_steps: int, sampling_rows, on_step: Callable[[StepOutput], None],
                       timings: WindowTimings, should_cut: Callable[[], bool] | None, tail: WindowTail | None,
                       defer_tail: bool) -> WindowTimings:
        """All steps of a decode-only window as graph replays; tokens stream as each step's copy lands."""
        clock, rows_n = self.clock, len(sampling_rows)
        outputs = StepStream(on_step, timings, self.host_ring, hold=TAIL_STEPS if defer_tail else 0)
        emitted = graph.inputs["emitted"][:, :rows_n]
        for step in range(1, num_steps + 1):
            if step > 1 and should_cut is not None and _cut(outputs, should_cut):
                break
            clock.start(StepTag(step, "decode", rows_n))
            graph.graph.replay()
            clock.end()
            if step == 1:
                _deliver(tail, timings)
            timings.num_steps = step
            outputs.push(step, emitted, None, sync=self.host_ring is None)
        return self._end_window(outputs, timings, sampling_rows, graph.inputs, defer_tail)


def _deliver(tail: WindowTail | None, timings: WindowTimings) -> None:
    """Hands the previous window's last step over, its host time counted as this window's output work."""
    if tail is not None:
        started = time.perf_counter()
        tail.deliver()
        timings.output_s += time.perf_counter() - started


# Steps launched ahead of the host when a window may be cut: one runs while the host reads the one
# before, so the device never waits for the host, and a cut wastes at most this many steps' time.
CUT_LAUNCH_AHEAD = 1
# Overlap: the steps a window leaves on the device for the next to hand over (`WindowTail`). The host's
# work between windows (update, schedule, the next window's inputs; about 2.5 ms a window for SmolLM2 at
# rate inf on an H100 host) runs while they do, so one step hides it where steps are long (Llama-3-8B's
# 10 ms) and not where they are short (SmolLM2's 1.5-2 ms). More than one holds the host's knowledge of
# finishes back by as many steps: a row that ends in them costs the next window a done row. Any depth
# gives the same tokens (tests/engine/test_overlap.py). Served on an H100 (docs/BENCHMARKS.md): 2 halved
# SmolLM2's idle time between windows against 1 (+3-6% req/s), 3 gained nothing over 2, and
# Llama-3-8B was level.
TAIL_STEPS = 2


def _cut(outputs: StepStream, should_cut: Callable[[], bool]) -> bool:
    outputs.drain(keep=CUT_LAUNCH_AHEAD)
    return should_cut()
