"""What the step-gap timer costs: the same decode workload with the runner's `StepClock` (CUDA events on
the compute stream, from a pool, harvested with query()) and with a clock that records nothing,
alternated; plus the gaps it measures and how often the clock had to wait for the device (expected 0).

    PYTHONPATH=.:engine python benchmarks/gap_timer_cost.py --model random:llama-3-8b --steps 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams


class NullClock:
    """Timer off: no events recorded, no host clock read, nothing harvested (the runner counts steps)."""

    num_forced_syncs = 0

    def begin_window(self, continuing: bool) -> None:
        pass

    def start(self, tag) -> None:
        pass

    def end(self) -> None:
        pass

    def drop_start(self) -> None:
        pass

    def harvest(self) -> list:
        return []


def run(llm: LLM, prompts, params) -> dict:
    engine = llm.engine
    stats = engine.core.stats
    stats.gaps_s.clear()
    stats.boundary_gaps_s.clear()
    tokens_before = stats.num_generated_tokens
    started = time.perf_counter()
    for prompt, param in zip(prompts, params):
        engine.add_request(prompt, param)
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - started
    tokens = stats.num_generated_tokens - tokens_before
    return {"tokens_per_s": tokens / elapsed, "elapsed_s": elapsed, "tokens": tokens,
            "intra_gap_us": 1e6 * statistics.median(stats.gaps_s) if stats.gaps_s else None,
            "boundary_gap_us": 1e6 * statistics.median(stats.boundary_gaps_s) if stats.boundary_gaps_s else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = LLM(args.model, num_scheduler_steps=args.steps[0], max_num_seqs=args.batch, max_model_len=1024)
    vocab = base.engine.model_config.vocab_size
    prompts = [[(97 * i + 13 * k) % (vocab - 3) + 3 for k in range(16)] for i in range(args.batch)]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)] * args.batch
    results = {}
    for n in args.steps:
        llm = LLM(args.model, share_model_with=base, num_scheduler_steps=n, max_num_seqs=args.batch,
                  max_model_len=1024)
        runner = llm.engine.executor.runner
        real_clock = runner.clock
        run(llm, prompts[:8], params[:8])  # warm-up: graphs, allocator, pinned host buffers
        forced_before = real_clock.num_forced_syncs
        on, off = [], []
        for _ in range(args.repeats):
            runner.clock = real_clock
            on.append(run(llm, prompts, params))
            runner.clock = NullClock()
            off.append(run(llm, prompts, params))
        runner.clock = real_clock
        on_tps = statistics.median(r["tokens_per_s"] for r in on)
        off_tps = statistics.median(r["tokens_per_s"] for r in off)
        results[f"N={n}"] = {
            "timer_on_tokens_per_s": on_tps, "timer_off_tokens_per_s": off_tps,
            "timer_cost_percent": 100 * (off_tps - on_tps) / off_tps,
            "intra_gap_us_median": statistics.median(r["intra_gap_us"] for r in on if r["intra_gap_us"] is not None)
            if n > 1 else None,
            "boundary_gap_us_median": statistics.median(r["boundary_gap_us"] for r in on),
            "forced_syncs": real_clock.num_forced_syncs - forced_before,
            "host_ring_slots": runner.host_ring.num_slots if runner.host_ring is not None else None,
            "runs_on": on, "runs_off": off}
        print(f"N={n}: timer on {on_tps:.0f} tok/s, off {off_tps:.0f} tok/s "
              f"({results[f'N={n}']['timer_cost_percent']:+.2f}% cost); intra gap "
              f"{results[f'N={n}']['intra_gap_us_median']} us, boundary gap "
              f"{results[f'N={n}']['boundary_gap_us_median']:.0f} us, forced syncs "
              f"{results[f'N={n}']['forced_syncs']}", flush=True)
    out = os.environ.get("OUT", ".bench")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gap_timer_cost.json"), "w") as handle:
        json.dump({"model": args.model, "batch": args.batch, "max_tokens": args.max_tokens, "results": results},
                  handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
