"""Tensor and pipeline parallelism on the GPUs of one host, with NCCL: greedy tokens of each layout
against one GPU, and the sharegpt-synth throughput per layout and N. Each (layout, N) runs in its own
process (the leader starts its worker ranks itself, one GPU per rank) under a time limit, so a layout
that fails or hangs is reported and the others still run. Prints one table; writes JSON to $OUT.

    PYTHONPATH=.:engine python benchmarks/gpu_parallel_run.py --layouts 1x1 2x1 1x2 --steps 8 1 \\
        --num-prompts 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

OUT = os.environ.get("OUT", ".bench")
HERE = os.path.dirname(os.path.abspath(__file__))


def log(message: str) -> None:
    print(f"[gpu_parallel_run] {message}", file=sys.stderr, flush=True)


def match_prompts(vocab: int) -> list[list[int]]:
    # the same 64 prompts as gpu_run.greedy_match
    return [[(7919 * i + 31 * k) % (vocab - 1000) + 1000 for k in range(16 + 5 * i)] for i in range(64)]


def warm_up(llm, max_rows: int, steps: int) -> None:
    """Runs windows of every decode-graph bucket size, on every rank alike, before the timed run (a
    leader-only graphs.warmup() would leave the workers out of the captured collectives)."""
    from lockstep_engine.runner.cuda_graphs import BUCKETS
    from lockstep_engine.sampling_params import SamplingParams

    sizes = sorted((b for b in BUCKETS if b <= max_rows), reverse=True)
    prompts, params = [], []
    for w, size in enumerate(sizes):  # size - next size rows finish at the end of window w
        following = sizes[w + 1] if w + 1 < len(sizes) else 0
        for _ in range(size - following):
            prompts.append({"prompt_token_ids": [1 + len(prompts) % 500] * 8})
            params.append(SamplingParams(temperature=0.0, max_tokens=steps * (w + 1) + 1, ignore_eos=True))
    llm.generate(prompts, params)


def run_one(args) -> int:
    """One layout at one N, in this process: greedy tokens (at N=8), then the workload."""
    sys.path.insert(0, HERE)
    from gpu_run import prefill_warm_up, run_workload

    from lockstep.bench.workload import make_workload
    from lockstep.bench.offline import greedy_requests
    from lockstep_engine.llm import LLM
    from lockstep_engine.sampling_params import SamplingParams

    tp, pp, n = args.one
    started = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_scheduler_steps=n,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    result = {"tp": tp, "pp": pp, "steps": n, "start_s": time.perf_counter() - started,
              "graphs": llm.engine.executor.runner.graphs is not None}
    log(f"TP={tp} PP={pp} N={n}: engine up in {result['start_s']:.1f}s (graphs: {result['graphs']})")
    workload = make_workload("sharegpt-synth", args.num_prompts, seed=0,
                             vocab_size=llm.engine.model_config.vocab_size)
    prompts, params = greedy_requests(workload)
    warm_up(llm, args.max_num_seqs, n)
    prefill_warm_up(llm, prompts)
    llm.engine.core.stats = type(llm.engine.core.stats)()  # the timed run's counters only
    result["run"] = run_workload(llm, prompts, params, f"TP={tp} PP={pp} N={n}")
    if n == 8:  # after the workload, whose figures come from the engine's counters
        vocab = llm.engine.model_config.vocab_size
        outs = llm.generate([{"prompt_token_ids": p} for p in match_prompts(vocab)],
                            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2))
        result["greedy"] = [o.outputs[0].token_ids for o in outs]
        result["greedy_top2"] = [[[t[1] for t in lp.top[:2]] for lp in o.outputs[0].logprobs] for o in outs]
    json.dump(result, open(args.result, "w"))
    return 0


def top2_gap(result: dict, prompt: int, position: int) -> float | None:
    top = result["greedy_top2"][prompt][position]
    return round(top[0] - top[1], 5) if len(top) > 1 else None


def compare(base: dict, other: dict) -> dict:
    same, gaps = 0, []
    for i, (a, b) in enumerate(zip(base["greedy"], other["greedy"])):
        if a == b:
            same += 1
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        gaps.append({"prompt": i, "position": k, "base_top2_gap": top2_gap(base, i, k)})
    return {"identical": same, "prompts": len(base["greedy"]), "divergences": gaps[:16]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP")
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per (layout, N) process")
    parser.add_argument("--one", type=int, nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_one(args)
    os.makedirs(OUT, exist_ok=True)
    results, errors = {}, {}
    scratch = tempfile.mkdtemp()
    for layout in args.layouts:
        tp, pp = (int(x) for x in layout.split("x"))
        for n in args.steps:
            name = f"TP={tp} PP={pp} N={n}"
            path = os.path.join(scratch, f"{tp}x{pp}_{n}.json")
            command = [sys.executable, __file__, "--one", str(tp), str(pp), str(n), "--result", path,
                       "--model", args.model, "--num-prompts", str(args.num_prompts),
                       "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                       "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
            log(f"{name}: starting")
            child = subprocess.Popen(command, start_new_session=True)
            try:
                code = child.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)
                child.wait()
                code = "timeout"
            if code == 0 and os.path.exists(path):
                results[name] = json.load(open(path))
            else:
                errors[name] = f"exit {code}"
                log(f"{name}: failed ({code})")
            summary = {"results": {k: {x: v for x, v in r.items() if not x.startswith("greedy")}
                                   for k, r in results.items()}, "errors": errors}
            json.dump(summary, open(os.path.join(OUT, "parallel.json"), "w"), indent=2)
    base = results.get("TP=1 PP=1 N=8")
    matches = {}
    for name, r in results.items():
        if base is not None and "greedy" in r and r is not base:
            matches[name] = compare(base, r)
    summary["greedy_vs_tp1"] = matches
    json.dump(summary, open(os.path.join(OUT, "parallel.json"), "w"), indent=2)
    print(f"{'run':<18}{'req/s':>8}{'out tok/s':>10}{'TPOT med ms':>12}{'gap us':>8}{'bnd us':>8}{'idle':>7}"
          f"{'start s':>9}")
    for name, r in results.items():
        w = r["run"]
        print(f"{name:<18}{w['req_per_s']:>8.2f}{w['output_tok_per_s']:>10.0f}{w['tpot_ms']['median']:>12.1f}"
              f"{w['mean_gap_us']:>8.0f}{w['mean_boundary_gap_us']:>8.0f}{w['idle_fraction']:>7.1%}{r['start_s']:>9.1f}")
    for name, m in matches.items():
        print(f"greedy {name} vs TP=1: {m['identical']}/{m['prompts']} identical; first divergences "
              f"{m['divergences'][:4]}")
    for name, error in errors.items():
        print(f"ERROR {name}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
