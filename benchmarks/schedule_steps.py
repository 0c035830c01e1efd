"""How many steps and windows a scheduling setting needs for the sharegpt-synth workload.

The count of forwards, the windows and the rows per step depend on the scheduler alone (admission
order, seats, prefill budget, N), not on the device, so this runs the real engine with `random:tiny`
on the CPU (a model small enough that 1000 requests take a few minutes) and counts. The GPU
headline's run time is roughly steps x step time, and step time grows with the rows in a step, so
the table says which settings can help before device time is spent on them.

    PYTHONPATH=.:engine LOCKSTEP_CPU_THREADS=1 python benchmarks/schedule_steps.py \\
        --runs "n=8" "n=8,policy=lof" "n=16,seqs=512,policy=lof"
"""

from __future__ import annotations

import argparse
import statistics
import sys

from lockstep.bench.workload import make_workload
from lockstep_engine.config import num_scheduler_steps_arg
from lockstep.bench.offline import greedy_requests, run_offline
from lockstep_engine.llm import LLM

KEYS = ("n", "mbt", "seqs", "policy")


def parse_run(spec: str, args) -> dict:
    values = {"n": "8", "mbt": str(args.max_num_batched_tokens), "seqs": str(args.max_num_seqs), "policy": "fcfs"}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in KEYS or not value:
            raise SystemExit(f"--runs: {item!r} is invalid: expected one of {', '.join(k + '=' for k in KEYS)}")
        values[key] = value
    return {"num_scheduler_steps": num_scheduler_steps_arg(values["n"]), "max_num_batched_tokens": int(values["mbt"]),
            "max_num_seqs": int(values["seqs"]), "scheduling_policy": values["policy"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--num-gpu-blocks", type=int, default=40000, help="KV cache blocks (GPU run 5 had 53426)")
    parser.add_argument("--runs", nargs="+", default=["n=8", "n=8,policy=lof"], metavar="KEY=VALUE,...")
    args = parser.parse_args()
    runs = [(spec, parse_run(spec, args)) for spec in args.runs]
    # vocab 1024 (random:tiny): the workload's lengths do not depend on the vocabulary, only its ids
    prompts, params = greedy_requests(make_workload("sharegpt-synth", args.num_prompts, seed=0, vocab_size=1024))
    base = LLM("random:tiny", device="cpu", max_model_len=2048, num_gpu_blocks_override=args.num_gpu_blocks)
    print(f"{'run':<28}{'steps':>7}{'windows':>9}{'mean rows':>11}{'steps <= 16 rows':>18}{'preempted':>11}"
          f"{'cpu s':>8}")
    for spec, kwargs in runs:
        llm = LLM("random:tiny", share_model_with=base, device="cpu", max_model_len=2048,
                  num_gpu_blocks_override=args.num_gpu_blocks, **kwargs)
        run = run_offline(llm, prompts, params, progress=lambda message: print(f"[schedule_steps] {spec}: {message}",
                                                                             file=sys.stderr, flush=True),
                          progress_every_s=60)
        stats = llm.engine.core.stats
        rows = stats.step_batch_sizes
        print(f"{spec:<28}{stats.num_steps:>7}{stats.num_windows:>9}{statistics.fmean(rows):>11.1f}"
              f"{sum(1 for r in rows if r <= 16):>18}{llm.engine.core.scheduler.num_preemptions:>11}"
              f"{run.elapsed_s:>8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
