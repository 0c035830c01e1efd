"""Where a prefill step's device time goes, per kernel group, against its FLOP or byte bound.

Steps of one prompt chunk (`--chunks` tokens, no cached context) and a mixed step (a `--mixed-chunk`
token chunk plus `--mixed-decode-rows` decode rows at `--context` tokens each), each run through the
model's forward and the sampling rows' logits and argmax, as a window's first step runs them (eagerly:
prefill-carrying steps are not graphed). torch.profiler times each kernel over `--repeats` steps
after two warm-up steps; groups are decode_profile.py's. Bounds: GEMMs and attention are the larger
of their FLOPs at `--matmul-tflops` and their bytes at the measured copy bandwidth; the other groups
their bytes. Prints one table; the numbers go to $OUT/prefill_profile.json, the kernel tables to
$OUT/prefill_profile.txt.

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/prefill_profile.py            # on the H200
    PYTHONPATH=$PWD:$PWD/engine python benchmarks/prefill_profile.py --model random:tiny --device cpu \
        --chunks 64 --mixed-chunk 32 --mixed-decode-rows 4 --context 20 --repeats 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from decode_profile import copy_bandwidth, group_of, group_times, sync
from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.llm import LLM

OUT = os.environ.get("OUT", ".bench")


def log(message: str) -> None:
    print(f"[prefill_profile] {message}", file=sys.stderr, flush=True)


def step_inputs(rows: list[tuple[int, int]], block_size: int, vocab: int, device) -> dict:
    """One step's flattened inputs for `rows` of (cached context, new tokens), each row in blocks of its own."""
    ids, positions, slots, starts, tables, next_block = [], [], [], [0], [], 0
    for row, (context, new) in enumerate(rows):
        blocks = -(-(context + new) // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        tables.append(table)
        for position in range(context, context + new):
            ids.append((31 * row + 7 * position) % (vocab - 1) + 1)
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
        starts.append(starts[-1] + new)
    width = max(map(len, tables))
    table = torch.tensor([t + [next_block] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)
    seq_lens = [c + n for c, n in rows]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    meta = AttentionMetadata(slot_mapping=as_tensor(slots), block_tables=table, seq_lens=as_tensor(seq_lens),
                             query_start_loc=as_tensor(starts), query_start_loc_host=starts,
                             seq_lens_host=seq_lens, max_seq_len=max(seq_lens))
    return {"input_ids": as_tensor(ids), "positions": as_tensor(positions), "meta": meta,
            "sample_index": as_tensor([end - 1 for end in starts[1:]]), "blocks": next_block}


def bounds(mc, rows, element: int, bandwidth: float, flops_per_s: float) -> dict[str, float]:
    """µs each group needs at least in one step of `rows`: max(FLOPs / rate, bytes / bandwidth)."""
    h, i, layers, vocab = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    tokens, sampled = sum(n for _, n in rows), len(rows)
    per_token = h * (q + 2 * kv) + q * h + 3 * h * i
    gemm_flops = 2 * tokens * layers * per_token + 2 * sampled * vocab * h
    gemm_bytes = element * (layers * per_token + vocab * h
                            + tokens * layers * (h + q + 2 * kv + q + h + h + 2 * i + i + h) + sampled * (h + vocab))
    # causal: new token j of a row sees context + j + 1 keys; QK^T and PV are 2 FLOPs per multiply-add each
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in rows)
    attention_flops = 4 * layers * mc.num_attention_heads * mc.head_dim * pairs
    attention_bytes = element * layers * (sum(2 * kv * (c + n) for c, n in rows) + 2 * tokens * q)

    def at_bound(flops, size):
        return max(flops / flops_per_s, size / bandwidth) * 1e6

    return {
        "gemm": at_bound(gemm_flops, gemm_bytes),
        "attention": at_bound(attention_flops, attention_bytes),
        "rmsnorm": element * (2 * layers + 1) * 4 * tokens * h / bandwidth * 1e6,
        "rotary+kv write": element * layers * tokens * 2 * (q + 2 * kv) / bandwidth * 1e6,
        "silu_mul": element * layers * tokens * 3 * i / bandwidth * 1e6,
        "sampling": element * sampled * vocab / bandwidth * 1e6,
        "_gemm_flops": gemm_flops, "_attention_flops": attention_flops,
    }


def profile_step(model, inputs: dict, device: str, repeats: int) -> tuple[dict[str, float], str]:
    def run():
        hidden = model(inputs["input_ids"], inputs["positions"], inputs["meta"])
        return model.compute_logits(hidden[inputs["sample_index"]]).argmax(dim=-1)

    for _ in range(2):
        run()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            run()
        sync(device)
    times = group_times(prof, device, repeats)
    others = sorted(((e.self_device_time_total if device == "cuda" else e.self_cpu_time_total) / repeats, e.key)
                    for e in prof.key_averages() if group_of(e.key) == "other" and not e.key.startswith("aten::"))
    times_others = {key: us for us, key in others[::-1][:8] if us > 0}
    sort_key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=25, max_name_column_width=90)
    return times, times_others, table


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--mixed-chunk", type=int, default=2048)
    parser.add_argument("--mixed-decode-rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=325, help="cached tokens of each decode row of the mixed step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--matmul-tflops", type=float, default=790.0, help="measured bf16 matmul rate (H200)")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    steps = {f"chunk {n}": [(0, n)] for n in args.chunks}
    steps[f"chunk {args.mixed_chunk} + {args.mixed_decode_rows} decode"] = \
        [(0, args.mixed_chunk)] + [(args.context, 1)] * args.mixed_decode_rows
    longest = max(c + n for rows in steps.values() for c, n in rows)
    blocks = max(sum(-(-(c + n) // 16) for c, n in rows) for rows in steps.values()) + 1
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    llm = LLM(args.model, device=args.device, dtype=dtype, max_model_len=longest, num_gpu_blocks_override=blocks,
              max_num_batched_tokens=max(sum(n for _, n in rows) for rows in steps.values()),
              attention_backend=args.attention_backend, enforce_eager=True)
    runner = llm.engine.executor.runner
    model, mc = runner.model, llm.engine.model_config
    element = torch.empty((), dtype=runner.dtype).element_size()
    bandwidth = copy_bandwidth(args.device)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, attention backend {runner.backend.name}")
    results, texts = {}, []
    with torch.inference_mode():
        for name, rows in steps.items():
            inputs = step_inputs(rows, runner.block_size, mc.vocab_size, runner.device)
            times, others, table = profile_step(model, inputs, args.device, args.repeats)
            limits = bounds(mc, rows, element, bandwidth, args.matmul_tflops * 1e12)
            results[name] = {"times_us": times, "bounds_us": {k: v for k, v in limits.items() if not k.startswith("_")},
                             "gemm_flops": limits["_gemm_flops"], "attention_flops": limits["_attention_flops"],
                             "other_kernels_us": others}
            texts.append(f"== {name}: {sum(times.values()) / 1e3:.3f} ms\n{table}")
            log(f"{name}: {sum(times.values()) / 1e3:.3f} ms; largest 'other' kernels (us): "
                + ", ".join(f"{key[:60]} {us:.0f}" for key, us in others.items()))
    with open(os.path.join(OUT, "prefill_profile.txt"), "w") as handle:
        handle.write("\n\n".join(texts))
    with open(os.path.join(OUT, "prefill_profile.json"), "w") as handle:
        json.dump({"bandwidth_TBps": bandwidth / 1e12, "backend": runner.backend.name, "steps": results}, handle,
                  indent=1)
    print_table(results, bandwidth, args.matmul_tflops, runner.backend.name)
    return 0


def print_table(results: dict, bandwidth: float, tflops: float, backend: str) -> None:
    print(f"prefill step per kernel group (us per step, measured / bound), copy bandwidth {bandwidth / 1e12:.2f} "
          f"TB/s, matmul {tflops:.0f} TFLOP/s, attention backend {backend}")
    print("| group | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    groups = sorted({g for r in results.values() for g in r["times_us"]},
                    key=lambda g: -max(r["times_us"].get(g, 0.0) for r in results.values()))
    for group in groups + ["step"]:
        cells = []
        for r in results.values():
            if group == "step":
                us = sum(r["times_us"].values())
                bound = sum(r["bounds_us"][g] for g in r["times_us"] if g in r["bounds_us"])
            else:
                us, bound = r["times_us"].get(group), r["bounds_us"].get(group)
            if us is None:
                cells.append("-")
            elif bound:
                cells.append(f"{us:.0f} / {bound:.0f} ({us / bound:.2f}x)")
            else:
                cells.append(f"{us:.0f} / -")
        print(f"| {group} | " + " | ".join(cells) + " |")
    rates = []
    for name, r in results.items():
        gemm, attention = r["times_us"].get("gemm"), r["times_us"].get("attention")
        rates.append(f"{name}: GEMMs {r['gemm_flops'] / gemm / 1e6:.0f}" if gemm else f"{name}: GEMMs -")
        if attention:
            rates[-1] += f", attention {r['attention_flops'] / attention / 1e6:.0f}"
    print("achieved TFLOP/s: " + "; ".join(rates))


if __name__ == "__main__":
    sys.exit(main())
