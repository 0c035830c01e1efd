"""Speculative decoding with n-gram drafting on SmolLM2's real weights, on the CPU: for a copying task, a
code task and free chat, one request at a time and greedy, the tokens each target forward produced,
the acceptance rate of the drafts, and the wall time against the same engine without speculation
(whose output must be the same tokens: the run stops if not).

    PYTHONPATH=$PWD:$PWD/engine LOCKSTEP_CPU_THREADS=2 python benchmarks/spec_decode.py

Prints one row per task and `--num-speculative-tokens`; the numbers go to $OUT/spec_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams

OUT = os.environ.get("OUT", ".bench")
ARTICLE = ("The printing press spread across Europe within fifty years of Gutenberg's first Bible. Scholars "
           "could compare identical copies of a text, errors could be corrected in later editions, and ideas "
           "travelled faster than ever before.")
TASKS = {
    "copy": [{"role": "user", "content": f"Copy this paragraph word for word, nothing else:\n\n{ARTICLE}"}],
    "code": [{"role": "user", "content": "Here is a function:\n\ndef area(width, height):\n    return width * height\n\n"
                                         "Write the same function again with a docstring and type hints."}],
    "chat": [{"role": "user", "content": "What are three good habits for staying healthy?"}],
}


def log(message: str) -> None:
    print(f"[spec_decode] {message}", file=sys.stderr, flush=True)


def run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """Output tokens, wall seconds and target forwards of one greedy request on an idle engine."""
    steps_before = llm.engine.core.stats.num_steps
    started = time.perf_counter()
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return out.outputs[0].token_ids, time.perf_counter() - started, llm.engine.core.stats.num_steps - steps_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    args = parser.parse_args()
    base = LLM("smollm2", num_scheduler_steps=args.num_scheduler_steps, kv_cache_memory_bytes=512 << 20,
               enable_prefix_caching=False)
    results = []
    for task, messages in TASKS.items():
        prompt = base.apply_chat_template(messages)
        run(base, prompt, 4)  # warm-up
        expected, base_s, base_steps = run(base, prompt, args.max_tokens)
        for k in args.num_speculative_tokens:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                    "prompt_lookup_min": args.prompt_lookup_min}
            llm = LLM("smollm2", share_model_with=base, num_scheduler_steps=args.num_scheduler_steps,
                      kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False, speculative_config=spec)
            tokens, spec_s, spec_steps = run(llm, prompt, args.max_tokens)
            if tokens != expected:
                raise SystemExit(f"{task}, K={k}: speculative output differs from the target's")
            counts = llm.engine.core.stats.spec
            row = {"task": task, "k": k, "tokens": len(tokens), "prompt_tokens": len(prompt),
                   "target_steps": spec_steps, "tokens_per_step": len(tokens) / spec_steps,
                   "acceptance_rate": counts.num_accepted_tokens / max(counts.num_draft_tokens, 1),
                   "accepted_per_pos": list(counts.accepted_per_pos),
                   "num_drafts": counts.num_drafts, "spec_s": spec_s, "base_s": base_s, "base_steps": base_steps,
                   "speedup": base_s / spec_s}
            results.append(row)
            log(f"{task} K={k}: {row['tokens_per_step']:.2f} tokens/step, acceptance {row['acceptance_rate']:.2f}, "
                f"{spec_s:.2f}s vs {base_s:.2f}s")
    print(f"{'task':6} {'K':>2} {'tokens':>6} {'steps':>5} {'tok/step':>8} {'accept':>6} {'spec s':>7} {'base s':>7} "
          f"{'speedup':>7}")
    for r in results:
        print(f"{r['task']:6} {r['k']:>2} {r['tokens']:>6} {r['target_steps']:>5} {r['tokens_per_step']:>8.2f} "
              f"{r['acceptance_rate']:>6.2f} {r['spec_s']:>7.2f} {r['base_s']:>7.2f} {r['speedup']:>7.2f}")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "spec_decode.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
