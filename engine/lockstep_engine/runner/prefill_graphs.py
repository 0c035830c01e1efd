"""CUDA graphs for the forward of a window's first step when it carries prompt tokens.

Step 1 of a window computes every row's scheduled tokens (prefill chunks, or chunks and decode rows
mixed). Its token count changes from window to window, so it ran eagerly: one launch per kernel, about
ten per layer. For a small model that launching is the step: a served random:smollm2-135m run on an
H100 spent 1.34 s of its 4.49 s of device time in 90 such steps, about 15 ms each for 1-2 ms of
kernels (docs/BENCHMARKS.md). Here the model's forward (the sampling after it stays eager) is captured
once per token bucket over static buffers, and such a step is one replay:

* the step's tokens padded to the bucket: padding tokens write the sink slot and belong to no sequence;
* its sequences padded to `max_seqs` empty ones (query start at the step's end, length 0), its block
  table to max_model_len's width (the sink block beyond): the Triton prefill kernel finds each tile's
  sequence on the device (`_find_seq`), and a tile of an empty sequence returns at once, so one graph
  serves any mix of sequences that fits;
* the hidden states copied into one buffer of the largest bucket's size, read by the eager sampling.

Padding costs device time (up to a bucket step of tokens), so with `--prefill-cuda-graphs auto` graphs
are used only where they win: `launch_bound()` times one bucket eagerly and as a replay at warm-up, and
the graphs are captured when the replay takes at most half of the eager step (a small model; an 8B
model's step is device time either way). LoRA, more than one rank, and attention backends whose
prefill needs host values per step stay eager. `auto` is the default: on an H100 it took
random:smollm2-135m served at rate inf from 160 to 196 req/s (prefill-carrying device time 1.58 -> 0.41 s;
docs/BENCHMARKS.md), and an 8B model's probe keeps its first steps eager.
"""

from __future__ import annotations

import time

import torch

from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.runner.cuda_graphs import capture

SMALL_BUCKETS = (16, 32, 64, 128, 256)
BUCKET_STEP = 512  # token buckets above SMALL_BUCKETS: multiples of this below the step's token budget, then it
WIN_RATIO = 0.5  # captured when a replay takes at most this share of the eager step's wall time
PROBE_TOKENS = 256  # the bucket `launch_bound` times


def token_buckets(max_tokens: int) -> list[int]:
    """The captured token counts for steps of up to `max_tokens` tokens."""
    buckets = [b for b in SMALL_BUCKETS if b < max_tokens]
    return buckets + list(range(BUCKET_STEP, max_tokens, BUCKET_STEP)) + [max_tokens]


class PrefillGraphs:
    """The captured first-step forwards of one runner: `usable(first)`, then `forward(first)`."""

    def __init__(self, steps, max_tokens: int, max_seqs: int, pool=None, capture_graphs: bool = True):
        self.steps = steps
        self.capture_graphs = capture_graphs
        self.pool = pool
        self.buckets = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        device = steps.device
        i64 = dict(dtype=torch.int64, device=device)
        top = self.buckets[-1]
        width = -(-steps.max_model_len // steps.block_size)
        self.sink_block = steps.num_blocks
        self.input_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slots = torch.full((top,), steps.sink_slot, **i64)
        self.seq_lens = torch.zeros(max_seqs, **i64)
        self.query_start = torch.zeros(max_seqs + 1, **i64)
        self.table = torch.full((max_seqs, width), steps.num_blocks, **i64)
        self.hidden = torch.zeros(top, steps.hidden_size, dtype=steps.dtype, device=device)
        self.graphs: dict[int, object] = {}

    def usable(self, first) -> bool:
        meta = first.meta
        return (meta.query_start_loc is not None and meta.lora_slots is None
                and first.input_ids.shape[0] <= self.buckets[-1] and meta.seq_lens.shape[0] <= self.max_seqs)

    def forward(self, first) -> torch.Tensor:
        """The step's hidden states [tokens, hidden] from one replay (a view of the shared buffer, valid until
        the next replay)."""
        tokens = first.input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= tokens)
        self._load(first, bucket)
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = capture(lambda: self._body(bucket), self.steps.device, self.pool,
                                                  self.capture_graphs)
        graph.replay()
        return self.hidden[:tokens]

    def capture_all(self) -> int:
        """Captures every bucket, largest first (the smaller ones reuse its pool memory); returns how many."""
        for bucket in reversed(self.buckets):
            if bucket not in self.graphs:
                self._load_probe(bucket)  # sequences within the bucket: the warm-up runs read no token past it
                self.graphs[bucket] = capture(lambda b=bucket: self._body(b), self.steps.device, self.pool,
                                              self.capture_graphs)
        return len(self.graphs)

    def launch_bound(self, repeats: int = 3) -> tuple[bool, float, float]:
        """(graphs win, eager ms, replay ms) for a PROBE_TOKENS-token step of one sequence."""
        bucket = next(b for b in self.buckets if b >= min(PROBE_TOKENS, self.buckets[-1]))
        self._load_probe(bucket)
        device = self.steps.device
        eager = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            self._body(bucket)
            torch.cuda.synchronize(device)
            eager.append(time.perf_counter() - started)
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = capture(lambda: self._body(bucket), device, self.pool, self.capture_graphs)
        replay = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize(device)
            replay.append(time.perf_counter() - started)
        eager_s, replay_s = min(eager[1:]), min(replay[1:])
        return replay_s <= WIN_RATIO * eager_s, 1e3 * eager_s, 1e3 * replay_s

    # ---- inside ---------------------------------------------------------------------------------
    def _body(self, bucket: int) -> None:
        meta = AttentionMetadata(slot_mapping=self.slots[:bucket], block_tables=self.table, seq_lens=self.seq_lens,
                                 query_start_loc=self.query_start, max_seq_len=self.steps.max_model_len)
        if not self.capture_graphs:  # the CPU tests' torch backend loops over the sequences on the host
            meta.query_start_loc_host, meta.seq_lens_host = self.query_start.tolist(), self.seq_lens.tolist()
        hidden = self.steps.forward(self.input_ids[:bucket], self.positions[:bucket], meta)
        self.hidden[:bucket].copy_(hidden)

    def _load(self, first, bucket: int) -> None:
        meta = first.meta
        tokens, seqs = first.input_ids.shape[0], meta.seq_lens.shape[0]
        self.input_ids[:tokens].copy_(first.input_ids)
        self.positions[:tokens].copy_(first.positions)
        self.slots[:tokens].copy_(meta.slot_mapping)
        if bucket > tokens:
            self.input_ids[tokens:bucket].zero_()
            self.positions[tokens:bucket].zero_()
            self.slots[tokens:bucket].fill_(self.steps.sink_slot)
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        self.seq_lens[seqs:].zero_()
        self.query_start[:seqs + 1].copy_(meta.query_start_loc)
        self.query_start[seqs + 1:].fill_(tokens)
        table = meta.block_tables
        width = min(table.shape[1], self.table.shape[1])
        self.table.fill_(self.sink_block)
        self.table[:seqs, :width].copy_(table[:, :width])

    def _load_probe(self, bucket: int) -> None:
        """Sequences of the same length filling `bucket` tokens (at most max_seqs of them, none longer than
        max_model_len), their keys and values written to the sink: the inputs of timing and capture."""
        steps = self.steps
        length = min(max(-(-bucket // self.max_seqs), min(PROBE_TOKENS, bucket)), steps.max_model_len)
        seqs = min(-(-bucket // length), self.max_seqs)
        starts = torch.arange(seqs + 1, device=steps.device) * length
        self.input_ids[:bucket].fill_(1)
        self.positions[:bucket].copy_(torch.arange(bucket, device=steps.device) % length)
        self.slots.fill_(steps.sink_slot)
        self.seq_lens.zero_()
        self.seq_lens[:seqs].copy_((starts[1:].clamp(max=bucket) - starts[:-1]))
        self.query_start.fill_(min(seqs * length, bucket))
        self.query_start[:seqs + 1].copy_(starts.clamp(max=bucket))
        self.table.fill_(self.sink_block)
