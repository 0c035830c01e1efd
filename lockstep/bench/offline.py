"""Feeds a batch of requests to an offline engine and times it.

The loop shared by `lockstep bench throughput` and benchmarks/gpu_run.py, so their req/s and tok/s
mean the same thing: every request is added at once, and the clock runs from the first add to the
last finished request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lockstep.bench.workload import WorkloadRequest
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams


def greedy_requests(workload: Sequence[WorkloadRequest]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompt token ids, and greedy params that generate exactly each request's output_len (EOS ignored)."""
    prompts = [r.prompt_token_ids for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    return prompts, params


@dataclass(frozen=True)
class OfflineRun:
    request_ids: list[str]
    started_s: float  # time.perf_counter() before the first request was added
    elapsed_s: float  # from started_s until the last request finished
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return len(self.request_ids) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s


def run_offline(llm: LLM, prompts: Sequence[list[int]], params: Sequence[SamplingParams], *,
                progress: Callable[[str], None], progress_every_s: float, on_step=None) -> OfflineRun:
    """Adds every request, then steps the engine until all have finished.

    `progress` gets "done/total requests, elapsed" at most every `progress_every_s` seconds; `on_step`
    sees each step's core outputs, as `LLMEngine.step`'s callback does (e.g. for per-token latencies).
    """
    engine = llm.engine
    stats = engine.core.stats
    tokens_before = stats.num_generated_tokens
    started = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, last_report = 0, started
    while engine.has_unfinished_requests():
        done += sum(1 for out in engine.step(on_step=on_step) if out.finished)
        if time.perf_counter() - last_report > progress_every_s:
            last_report = time.perf_counter()
            progress(f"{done}/{len(ids)} requests, {last_report - started:.0f}s")
    elapsed = time.perf_counter() - started
    return OfflineRun(ids, started, elapsed, sum(len(p) for p in prompts),
                      stats.num_generated_tokens - tokens_before)
