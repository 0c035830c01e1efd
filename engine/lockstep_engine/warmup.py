"""Warm-up before ready: the kernels and graphs the server will use, compiled and captured at start-up.

Triton compiles a kernel per specialisation on first use and a decode graph is captured the first
time its batch bucket and sampling kind come up; a fresh server paid for both inside its first
requests (31.6 req/s on the first served run on an H200 against 41.2 warm, TTFT p50 15.1 s). `warm_up` runs
synthetic requests through an `EngineCore` over the serving executor before the core reports ready,
so the code paths are the serving ones (scheduler, window dispatch, graph capture, eager steps) and
every rank of a TP/PP group runs the same windows. It covers:

* prefill shapes: a first step of the full token budget, one token short of it (Triton specialises
  integer arguments on divisibility by 16), a prompt chunked over two windows (a chunk after a
  computed one), and many short prompts in one step;
* decode windows at every graph batch bucket up to `max_num_seqs`, for each sampling kind a graph is
  captured for (greedy, random, random with top-p/top-k/min-p filtering), at the configured window
  length (`auto`: windows of every length it chooses, from its first up to AUTO_MAX_STEPS);
* eager decode steps (logprobs rows never replay a graph) at context lengths that give every split
  count class of the Triton decode kernel (its `SPLITS_PAD`, a power of two up to 64).

The serving core is then a new `EngineCore` over the same executor: all KV blocks free, no prefix
cached from warm-up tokens, counters at zero, the core loop's seed generator untouched (warm-up
requests carry their own seeds). What stays is what is meant to: compiled kernels, captured graphs,
the allocator's pool, pinned host buffers.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from lockstep_engine.engine_core import EngineCore
from lockstep_engine.runner.cuda_graphs import BUCKETS
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import AUTO_MAX_STEPS
from lockstep_engine.sequence import Request

# The Triton decode kernel splits a row's context into chunks of at least this many tokens
# (`TritonPagedAttention.MIN_SPLIT_TOKENS`), at most 64 of them: contexts of 64 * (2^i + 1) tokens
# give split counts 2, 3, 5, 9, 17, 33, one per padded class; 64 * 16 gives 16 (a multiple of 16).
SPLIT_TOKENS = 64
SPLIT_CONTEXTS = tuple(SPLIT_TOKENS * k for k in (1, 2, 3, 5, 9, 16, 17, 33))
SHORT_PROMPT = 8  # tokens per prompt of the decode batches
CPU_BUDGET, CPU_ROWS = 256, 8  # the small plan's prefill tokens and largest decode batch
MAX_WINDOWS_PER_BATCH = 10_000  # a warm-up batch that takes more windows than this is a bug, not slowness

SAMPLING_KINDS = {  # the graph keys of `DecodeGraphs`: (all_greedy, any_filter)
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=1.0),
    "filtered": dict(temperature=1.0, top_p=0.9),
}


class WarmupError(RuntimeError):
    """A warm-up window failed: the server cannot serve what it would have run."""


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Row counts that hit every graph bucket a window of at most max_num_seqs rows can use, largest first."""
    sizes = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
    return sorted(sizes, reverse=True)


class _Plan:
    """The warm-up requests, in batches that run one after another (each batch to its end)."""

    def __init__(self, core: EngineCore, small: bool):
        """small: the same phases at a few small shapes (the CPU compiles nothing and captures no graphs;
        the path is exercised and start-up stays short)."""
        config = core.config
        self.small = small
        self.vocab = core.executor.model_config.vocab_size
        self.max_len = config.max_model_len
        self.budget = min(config.max_num_batched_tokens, CPU_BUDGET) if small else config.max_num_batched_tokens
        self.capacity = core.blocks.num_blocks * core.blocks.block_size
        self.max_seqs = core.scheduler.limits.max_num_seqs
        steps = config.num_scheduler_steps
        # One token more than the first window can take, so each batch has a decode-only window next.
        self.decode_tokens = (AUTO_MAX_STEPS if config.is_adaptive else steps) + 1
        self._count = 0

    def _tokens(self, length: int) -> list[int]:
        base = 7919 * self._count
        return [(base + 31 * k) % (self.vocab - 1) + 1 for k in range(length)]

    def request(self, prompt_len: int, max_tokens: int, **sampling) -> Request | None:
        """A warm-up request, or None when its prompt and output cannot fit the context or the cache."""
        prompt_len = min(prompt_len, self.max_len - max_tokens, self.capacity // 2 - max_tokens)
        if prompt_len < 2:
            return None
        self._count += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=self._count, **sampling)
        return Request(f"warmup-{self._count}", self._tokens(prompt_len), params, self.max_len, seed=self._count)

    def phases(self) -> list[tuple[str, list[list[Request]]]]:
        budget, tokens = self.budget, self.decode_tokens
        prefill = [[self.request(budget + 1, 2)], [self.request(budget, 2)], [self.request(2 * budget + 7, 2)],
                   [self.request(SHORT_PROMPT + k % 5, 2) for k in range(min(self.max_seqs, budget // 16))]]
        rows = [size for size in decode_batch_sizes(self.max_seqs) if size * SHORT_PROMPT <= self.capacity // 2]
        contexts, kinds = SPLIT_CONTEXTS, SAMPLING_KINDS
        if self.small:
            # The CPU compiles no kernel and captures no graph: one batch of each phase keeps the path
            # exercised while start-up stays short (measured: the full small plan took 7.5-19.5 s for
            # smollm2 on the 2-core machine).
            prefill, rows, contexts = prefill[1:2], [min(rows[0], CPU_ROWS)], SPLIT_CONTEXTS[:1]
            kinds = dict(list(SAMPLING_KINDS.items())[:1])
        phases = [("prefill shapes", prefill)]
        for kind, sampling in kinds.items():
            phases.append((f"decode windows, {kind} sampling, batches {rows[-1]}..{rows[0]}",
                           [[self.request(SHORT_PROMPT, tokens, **sampling) for _ in range(size)] for size in rows]))
        phases.append(("eager decode steps (logprobs) at contexts " + ", ".join(map(str, contexts)),
                       [[self.request(length, tokens, logprobs=1)] for length in contexts]))
        return [(name, [[r for r in batch if r is not None] for batch in batches]) for name, batches in phases]


def _run_batch(core: EngineCore, batch: list[Request]) -> None:
    for request in batch:
        core.add_request(request)
    for _ in range(MAX_WINDOWS_PER_BATCH):
        if not core.has_unfinished():
            return
        core.step(lambda step: None)
    raise WarmupError(f"a warm-up batch of {len(batch)} requests did not finish in {MAX_WINDOWS_PER_BATCH} windows")


def warm_up(core: EngineCore, log: Callable[[str], None]) -> EngineCore:
    """Runs the warm-up on `core` and returns a fresh core over the same executor, to serve with."""
    started = time.monotonic()
    log("warm-up: compiling kernels and capturing graphs before ready (--skip-warmup skips this)")
    runner = core.executor.runner
    phases = _Plan(core, small=runner.device.type != "cuda").phases()
    try:
        if hasattr(runner, "use_prefill_graphs"):
            prefill_started = time.monotonic()
            count = runner.use_prefill_graphs(log)
            if count:
                log(f"warm-up: captured {count} prefill graphs in {time.monotonic() - prefill_started:.1f}s")
        for name, batches in phases:
            phase_started = time.monotonic()
            for batch in batches:
                if batch:
                    _run_batch(core, batch)
            count = sum(len(batch) for batch in batches)
            log(f"warm-up: {name}: {count} requests in {time.monotonic() - phase_started:.1f}s")
    except Exception as error:
        raise WarmupError(f"warm-up failed: {error}") from error
    if getattr(runner, "lora", None) is not None and runner.graphs is not None:
        log(f"warm-up: captured {runner.graphs.capture_lora_twins()} decode graphs for windows with LoRA adapters")
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    runner.clock.harvest()  # warm-up steps' timings: not the serving core's
    graphs = runner.graphs.graphs if runner.graphs is not None else {}
    spec = runner.graphs.spec if runner.graphs is not None else None
    spec_note = f", {len(spec.captured)} speculative" if spec is not None else ""
    log(f"warm-up: done in {time.monotonic() - started:.1f}s ({core.stats.num_windows} windows, "
        f"{core.stats.num_steps} steps, {len(graphs)} decode graphs{spec_note} captured)")
    return EngineCore(core.config, core.executor)
