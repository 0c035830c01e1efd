"""CUDA graphs for the decode steps of a window.

A decode step (forward, sampling, feedback of the token, position/slot advance, stop masks) is
captured once per batch bucket; inside a window each step is then one graph replay, so the GPU
runs step after step while the host only enqueues replays and reads finished steps' tokens. A
window of decode rows only replays from its first step on (no eager forward at the boundary).
Windows needing per-step host work (guided decoding) or rarely used features (penalties, logprobs,
logit bias, allowed_token_ids, bad words) run eagerly, without a host sync all the same.
"""

from __future__ import annotations

import sys

import torch

from lockstep_engine.runner.window_state import DecodeState
from lockstep_engine.sampler import SamplingTensors

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_STOP_IDS = 8
_STATE_FIELDS = ("tokens", "positions", "done", "steps_done", "max_steps", "budget", "num_generated")
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "min_tokens")


def bucket_of(rows: int) -> int:
    """The smallest graph batch bucket that holds `rows` rows (at most BUCKETS[-1])."""
    return next(b for b in BUCKETS if b >= rows)


class _Eager:
    """Stands in for a captured graph: `replay()` runs the step's operations directly on the static
    buffers (`DecodeGraphs(capture=False)`; how the CPU tests check the buffer handling)."""

    def __init__(self, body):
        self.replay = body


class StaticState:
    """A bucket's static device buffers for a window's decode state (what a captured step reads and
    writes): `load` copies a window's `DecodeState` in, padding rows done; `state()` views them as one."""

    def __init__(self, steps, bucket: int, greedy: bool, filtered: bool, lora: bool = False):
        device, vocab = steps.device, steps.vocab_size
        width = -(-steps.max_model_len // steps.block_size)
        i64 = dict(dtype=torch.int64, device=device)
        self.bucket = bucket
        self.sink_block = steps.num_blocks
        self.inputs = {
            "tokens": torch.zeros(bucket, **i64), "positions": torch.zeros(bucket, **i64),
            "done": torch.ones(bucket, dtype=torch.bool, device=device), "steps_done": torch.zeros(bucket, **i64),
            "max_steps": torch.zeros(bucket, **i64), "budget": torch.zeros(bucket, **i64),
            "num_generated": torch.zeros(bucket, **i64),
            "table": torch.full((bucket, width), steps.num_blocks, **i64),
            "emitted": torch.full((2, bucket), -1, **i64),  # tokens; finish codes
        }
        # LoRA weight slot per row (a graph with adapters among its rows is captured apart from one without)
        self.lora_slots = torch.zeros(bucket, **i64) if lora else None
        self.sampling = SamplingTensors(
            temperature=torch.zeros(bucket, dtype=torch.float32, device=device),
            top_k=torch.full((bucket,), vocab, **i64),
            top_p=torch.ones(bucket, dtype=torch.float32, device=device),
            min_p=torch.zeros(bucket, dtype=torch.float32, device=device),
            seeds=torch.zeros(bucket, **i64), stop_ids=torch.full((bucket, MAX_STOP_IDS), -1, **i64),
            min_tokens=torch.zeros(bucket, **i64), presence=None, frequency=None, repetition=None,
            prompt_mask=None, logit_bias=None, all_greedy=greedy, any_filter=filtered, num_logprobs=-1)

    def state(self) -> DecodeState:
        return DecodeState(sampling=self.sampling, counts=None, table=self.inputs["table"],
                           lora_slots=self.lora_slots, **{name: self.inputs[name] for name in _STATE_FIELDS})

    def store(self, state: DecodeState) -> None:
        """Copies a step's new state back into the buffers (inside the captured body)."""
        for name in _STATE_FIELDS:
            self.inputs[name].copy_(getattr(state, name))

    def load(self, state) -> None:
        """Copies a window's decode state into the static buffers; padding rows are done."""
        rows = state.tokens.shape[0]
        for name in _STATE_FIELDS:
            buffer = self.inputs[name]
            buffer[:rows].copy_(getattr(state, name))
        self.inputs["done"][rows:].fill_(True)
        self.inputs["max_steps"][rows:].fill_(0)
        table = self.inputs["table"]
        table.fill_(self.sink_block)
        # A window's table may reach past max_model_len (a speculative window reserves K + 1 tokens a step
        # for its worst case); positions there write to the sink, so the columns past the buffer's are unused.
        width = min(state.table.shape[1], table.shape[1])
        table[:rows, :width].copy_(state.table[:, :width])
        for name in _SAMPLING_FIELDS:
            getattr(self.sampling, name)[:rows].copy_(getattr(state.sampling, name))
        if self.lora_slots is not None:
            self.lora_slots.zero_()
            self.lora_slots[:rows].copy_(state.lora_slots)
        stop = self.sampling.stop_ids
        stop.fill_(-1)
        stop[:rows, :state.sampling.stop_ids.shape[1]].copy_(state.sampling.stop_ids)


def capture(body, device: torch.device, pool, enabled: bool, reset=None):
    """`body` captured as a CUDA graph after two warm-up runs on a side stream (Triton compiles, the
    allocator settles; `reset` then restores the buffers they changed), or `_Eager(body)` when not
    `enabled` (the CPU tests)."""
    if not enabled:
        return _Eager(body)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(stream)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


class _Graph(StaticState):
    def __init__(self, steps, bucket: int, greedy: bool, filtered: bool, pool, capture_graph: bool = True,
                 lora: bool = False):
        super().__init__(steps, bucket, greedy, filtered, lora)

        def body():
            state = self.state()
            steps.step(state, steps.max_model_len, None)
            self.store(state)
            self.inputs["emitted"].copy_(state.emitted)

        self.graph = capture(body, steps.device, pool, capture_graph, reset=lambda: self.inputs["done"].fill_(True))


class DecodeGraphs:
    """The captured decode steps of one runner and attention backend, one graph per batch bucket and
    sampling kind, over the runner's `Steps` (`lockstep_engine.runner.steps`)."""

    def __init__(self, steps, capture: bool = True):
        self.steps = steps
        self.capture = capture
        self.graphs: dict[tuple[int, bool, bool, bool], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.sink_block = steps.num_blocks
        self.spec = None  # the speculative steps' graphs over this pool (`spec_window.SpecGraphs`), made on use

    def usable(self, state, guide) -> bool:
        t = state.sampling
        # The graphs hold no logit bias and no bad words: a window with either would sample without them.
        return (guide is None and state.counts is None and t.num_logprobs < 0 and t.logit_bias is None
                and t.bad_last is None and t.stop_ids.shape[1] <= MAX_STOP_IDS
                and state.tokens.shape[0] <= BUCKETS[-1])

    def _graph(self, rows: int, t: SamplingTensors, lora: bool = False) -> _Graph:
        bucket = bucket_of(rows)
        key = (bucket, t.all_greedy, t.any_filter, lora)
        if key not in self.graphs:
            self.graphs[key] = _Graph(self.steps, bucket, t.all_greedy, t.any_filter, self.pool, self.capture, lora)
        return self.graphs[key]

    def warmup(self, max_rows: int) -> None:
        """Captures the greedy graphs of every bucket up to max_rows before serving."""
        greedy = SamplingTensors(*([None] * 12), all_greedy=True, any_filter=False, num_logprobs=-1)
        for bucket in BUCKETS:
            if bucket > max(max_rows, 1) * 2 and bucket > BUCKETS[0]:
                break
            self._graph(bucket, greedy)
            print(f"[lockstep] captured decode graph for batch {bucket}", file=sys.stderr, flush=True)

    def capture_lora_twins(self) -> int:
        """Captures, for every graph without adapters, its twin for windows with adapters among their rows
        (with LoRA on, so the first adapter window replays instead of capturing); returns how many."""
        keys = [key for key in self.graphs if not key[3]]
        for bucket, greedy, filtered, _ in keys:
            if (bucket, greedy, filtered, True) not in self.graphs:
                self.graphs[(bucket, greedy, filtered, True)] = _Graph(self.steps, bucket, greedy, filtered, self.pool,
                                                                       self.capture, lora=True)
        return len(keys)

    def begin(self, state) -> _Graph:
        graph = self._graph(state.tokens.shape[0], state.sampling, state.lora_slots is not None)
        graph.load(state)
        return graph
