"""`lockstep bench throughput`: offline engine throughput on a synthetic workload, for several N.

Loads the model once and runs the same requests through engines that differ only in
`--num-scheduler-steps`, then prints one table (and JSON) with tokens/s and where host time goes.
"""

from __future__ import annotations

import argparse
import json
import sys

from lockstep.bench.offline import greedy_requests, run_offline
from lockstep.bench.workload import make_workload
from lockstep_common.argparsing import ArgumentParser
from lockstep_engine.config import SCHEDULING_POLICIES, num_scheduler_steps_arg
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="lockstep bench throughput", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--workload", default="sharegpt-synth", choices=["sharegpt-synth"])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-scheduler-steps", type=num_scheduler_steps_arg, nargs="+", default=[1, 8],
                        help="window lengths to compare (integers or auto)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--scheduling-policy", default="lof", choices=list(SCHEDULING_POLICIES))
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--decode-batch", type=int, default=32,
                        help="also time steady decode at this batch size (0: skip)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    return parser


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _run(llm: LLM, prompts, params) -> dict:
    stats = llm.engine.core.stats
    run = run_offline(llm, prompts, params, progress=_progress, progress_every_s=10)
    host = stats.schedule_s + stats.prepare_s + stats.output_s + stats.update_s
    return {
        "elapsed_s": run.elapsed_s,
        "requests_per_s": run.requests_per_s,
        "output_tokens_per_s": run.output_tokens_per_s,
        "total_tokens_per_s": run.total_tokens_per_s,
        "output_tokens": run.num_output_tokens,
        "windows": stats.num_windows,
        "steps": stats.num_steps,
        "mean_batch": sum(stats.step_batch_sizes) / max(len(stats.step_batch_sizes), 1),
        "per_step_ms": {
            "schedule": 1e3 * stats.schedule_s / max(stats.num_steps, 1),
            "prepare": 1e3 * stats.prepare_s / max(stats.num_steps, 1),
            "output": 1e3 * (stats.output_s + stats.update_s) / max(stats.num_steps, 1),
            "forward": 1e3 * stats.forward_s / max(stats.num_steps, 1),
        },
        "host_fraction": host / max(host + stats.forward_s, 1e-9),
        "mean_gap_ms": 1e3 * sum(stats.gaps_s) / max(len(stats.gaps_s), 1),
        "wasted_tokens": stats.num_wasted_tokens,
    }


def _table(rows: list[tuple[str, dict]]) -> str:
    header = (f"{'run':<22}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}{'batch':>7}{'sched':>8}"
              f"{'prep':>8}{'output':>8}{'fwd':>9}{'host%':>7}")
    lines = [header, "-" * len(header)]
    for name, r in rows:
        ms = r["per_step_ms"]
        lines.append(f"{name:<22}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}"
                     f"{r['total_tokens_per_s']:>11.1f}{r['mean_batch']:>7.1f}{ms['schedule']:>8.3f}"
                     f"{ms['prepare']:>8.3f}{ms['output']:>8.3f}{ms['forward']:>9.2f}{100 * r['host_fraction']:>6.1f}%")
    lines.append("per-step host time in ms: sched = scheduling, prep = input preparation, "
                 "output = output processing + state update; fwd = forward + sampling + advance")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    steps = args.num_scheduler_steps
    common = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device=args.device,
                  dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=args.scheduling_policy)
    base = LLM(args.model, num_scheduler_steps=steps[0], **common)
    vocab = base.engine.model_config.vocab_size
    prompts, params = greedy_requests(make_workload(args.workload, args.num_prompts, seed=args.seed,
                                                    vocab_size=vocab))
    results = []
    for n in steps:
        llm = LLM(args.model, share_model_with=base, num_scheduler_steps=n, **common)
        print(f"[bench] {args.workload}: {len(prompts)} requests, N={n}", file=sys.stderr, flush=True)
        results.append((f"{args.workload} N={n}", _run(llm, prompts, params)))
    if args.decode_batch:
        decode_prompts = [[(97 * i + 13 * k) % (vocab - 3) + 3 for k in range(8)] for i in range(args.decode_batch)]
        decode_params = [SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)] \
            * args.decode_batch
        for n in steps:
            llm = LLM(args.model, share_model_with=base, num_scheduler_steps=n,
                      **{**common, "max_num_seqs": args.decode_batch})
            print(f"[bench] steady decode: batch {args.decode_batch}, N={n}", file=sys.stderr, flush=True)
            results.append((f"decode b={args.decode_batch} N={n}", _run(llm, decode_prompts, decode_params)))
    print(_table(results))
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump({"model": args.model, "workload": args.workload, "num_prompts": args.num_prompts,
                       "results": dict(results)}, handle, indent=2)
    return 0
