"""Pipeline parallelism on the CPU: a window run as one batch vs as micro-batches in flight.

Two gloo ranks (one thread each) hold half of the layers each. With one micro-batch the stages
take turns; with one per stage, stage 0 computes micro-batch 2 while stage 1 computes micro-batch 1.
Prints decode throughput for each setting and checks both give the same greedy tokens.

    python benchmarks/cpu_pp_micro_batches.py [--model random:smollm2-135m] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUN = r"""
import json, sys, time
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams
model, pp, micro, steps, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5]), int(sys.argv[6])
llm = LLM(model, pipeline_parallel_size=pp, pipeline_micro_batches=micro, num_scheduler_steps=steps,
          kv_cache_memory_bytes=512 << 20, max_model_len=1024)
prompts = [{"prompt_token_ids": [(17 * i + 5 * k) % 2000 + 10 for k in range(16 + i % 8)]} for i in range(n)]
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
started = time.perf_counter()
outs = llm.generate(prompts, params)
elapsed = time.perf_counter() - started
steps = sorted(llm.engine.core.stats.decode_step_s)
print(json.dumps({"elapsed_s": elapsed, "decode_step_ms": 1e3 * steps[len(steps) // 2],
                  "tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    args = parser.parse_args()
    env = dict(os.environ, LOCKSTEP_CPU_THREADS="1")
    results = {}
    for label, pp, micro in (("PP=1", 1, 1), ("PP=2, 1 micro-batch", 2, 1), ("PP=2, 2 micro-batches", 2, 2)):
        print(f"running {label} ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-c", RUN, args.model, str(pp), str(micro),
                               str(args.num_scheduler_steps), str(args.num_prompts), str(args.max_tokens)],
                              capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            sys.exit(f"{label} failed:\n{done.stderr[-2000:]}")
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    reference = results["PP=1"]["tokens"]
    generated = args.num_prompts * args.max_tokens
    print(f"{args.model}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"N={args.num_scheduler_steps}, one thread per rank, {os.cpu_count()} cores")
    print(f"{'layout':<24}{'seconds':>9}{'gen tok/s':>11}{'decode step ms':>16}  same tokens as PP=1")
    for label, result in results.items():
        print(f"{label:<24}{result['elapsed_s']:>9.2f}{generated / result['elapsed_s']:>11.1f}"
              f"{result['decode_step_ms']:>16.1f}  {result['tokens'] == reference}")


if __name__ == "__main__":
    main()
