"""Where a decode step's device time goes, against each kernel group's byte bound.

For each batch size, an engine whose rows have all computed their prompts (`--context` tokens each)
runs one 8-step decode window (CUDA-graph replays, as served) under torch.profiler. Each device kernel
is put in a group by its name (attention, KV write, GEMMs, RMSNorm, rotary, SiLU-and-mul, sampling,
copies, other); each group's time per step is set against the fewest bytes it must move (weights read
once, KV read once, activations read and written once) at the measured copy bandwidth, and the GEMMs
also against their FLOPs at `--matmul-tflops`. Prints one table; the full profiles go to
$OUT/decode_profile.txt and the numbers to $OUT/decode_profile.json.

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/decode_profile.py                # on the H200
    PYTHONPATH=$PWD:$PWD/engine python benchmarks/decode_profile.py --model random:tiny --batches 4 8 \
        --context 64 --device cpu                                                  # CPU dry run (host times)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams

OUT = os.environ.get("OUT", ".bench")
STEPS = 8
# (group, substrings of a kernel's lower-cased name), first match wins.
GROUPS = (
    ("rotary+kv write", ("rotary_write_kv",)),
    ("kv write", ("write_kv",)),
    ("attention", ("decode_kernel", "decode_reduce", "prefill_kernel", "attention", "sdpa")),
    ("rmsnorm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("silu_mul", ("silu",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "addmm", "aten::mm", "matmul", "linear")),
    ("sampling", ("greedy_sample", "argmax", "softmax", "topk", "sort", "exponential", "gumbel", "reduce_kernel",
                  "max")),
    ("copies", ("memcpy", "memset", "copy")),
)


def log(message: str) -> None:
    print(f"[decode_profile] {message}", file=sys.stderr, flush=True)


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for group, keys in GROUPS if any(key in lowered for key in keys)), "other")


def group_times(prof, device: str, per: int) -> dict[str, float]:
    """A profile's kernel time per `group_of` group, in us over `per` (steps or repeats): device time on
    CUDA (the aten:: launchers, which hold no device time of their own, left out), CPU time on the CPU."""
    times: dict[str, float] = {}
    for event in prof.key_averages():
        spent = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if spent <= 0 or (device == "cuda" and event.key.startswith("aten::")):
            continue
        group = group_of(event.key)
        times[group] = times.get(group, 0.0) + spent / per
    return times


def copy_bandwidth(device: str) -> float:
    size = (2 << 30) if device == "cuda" else (256 << 20)
    x = torch.empty(size, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * size * 10 / (time.perf_counter() - start)  # bytes read + written per second


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def byte_bounds(mc, batch: int, context: float, element: int) -> dict[str, float]:
    """The fewest bytes each group moves in one decode step of `batch` rows at `context` tokens."""
    h, i, layers = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + mc.vocab_size * h  # lm_head included
    return {
        "gemm": element * (linear + batch * layers * (h + q + 2 * kv + q + h + h + 2 * i + i + h)
                           + batch * (h + mc.vocab_size)),
        "attention": element * batch * layers * (2 * kv * context + 2 * q),
        "kv write": element * batch * layers * 4 * kv,
        "rotary+kv write": element * layers * batch * 2 * (q + 2 * kv),  # q, k, v read once, written once
        "rmsnorm": element * ((2 * layers + 1) * (4 * batch * h + h)),  # x and residual in, both out
        "rotary": element * layers * batch * 2 * (q + kv),
        "silu_mul": element * layers * batch * 3 * i,
        "sampling": element * batch * mc.vocab_size,  # logits read once, in the model's dtype
    }


def decode_engine(base: LLM, batch: int, context: int, max_model_len: int) -> LLM:
    """An engine whose `batch` rows are all decoding, their prompts computed, this bucket's graph captured."""
    llm = LLM(base.engine.config.model, share_model_with=base, num_scheduler_steps=STEPS, max_num_seqs=batch,
              max_model_len=max_model_len, max_num_batched_tokens=16384)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    for row in range(batch):
        engine.add_request([(97 * row + k) % (vocab - 1) + 1 for k in range(context)],
                           SamplingParams(temperature=0.0, max_tokens=10 * STEPS, ignore_eos=True))
    while engine.core.scheduler.waiting:
        engine.step()
    engine.step()
    engine.step()  # a warm window: graphs captured, kernels compiled
    return llm


def profile_batch(base: LLM, batch: int, args, bandwidth: float) -> tuple[dict, str]:
    llm = decode_engine(base, batch, args.context, args.context + 16 * STEPS)
    engine, device = llm.engine, args.device
    running = engine.core.scheduler.running
    context = sum(len(seq.token_ids) for seq in running) / len(running) + STEPS / 2
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        engine.step()
        sync(device)
    times = group_times(prof, device, STEPS)  # us per step
    for request_id in list(engine.core.requests):
        engine.abort_request(request_id)
    mc = engine.model_config
    element = torch.empty((), dtype=base.engine.executor.runner.dtype).element_size()
    bounds = {name: size / bandwidth * 1e6 for name, size in byte_bounds(mc, batch, context, element).items()}
    for name in (("rotary", "kv write") if "rotary+kv write" in times else ("rotary+kv write",)):
        bounds.pop(name)  # the fused kernel's bound replaces the two separate ones, never both
    linear_flops = 2 * batch * (mc.num_parameters - mc.vocab_size * mc.hidden_size * (not mc.tie_word_embeddings))
    gemm_compute_us = linear_flops / (args.matmul_tflops * 1e12) * 1e6
    rows = {}
    for name in sorted(set(times) | set(bounds), key=lambda n: -times.get(n, 0.0)):
        bound = bounds.get(name)
        if name == "gemm":
            bound = max(bound, gemm_compute_us)
        rows[name] = {"us": times.get(name, 0.0), "bound_us": bound}
    total_us, total_bound = sum(times.values()), sum(max(r["bound_us"] or 0.0, 0.0) for r in rows.values())
    result = {"batch": batch, "context": context, "step_us": total_us, "bound_us": total_bound,
              "gemm_bytes_us": bounds["gemm"], "gemm_compute_us": gemm_compute_us, "groups": rows}
    sort_key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=30, max_name_column_width=90)
    return result, f"== batch {batch}, context {context:.0f}: {total_us / 1e3:.3f} ms per step\n{table}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--context", type=int, default=325, help="prompt tokens per row (the served runs' mean is about 325)")
    parser.add_argument("--matmul-tflops", type=float, default=790.0, help="measured bf16 matmul rate (H200)")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    base = LLM(args.model, device=args.device, dtype=dtype, num_scheduler_steps=STEPS, max_num_seqs=max(args.batches),
               max_model_len=args.context + 16 * STEPS)
    bandwidth = copy_bandwidth(args.device)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results, texts = [], []
    for batch in args.batches:
        result, text = profile_batch(base, batch, args, bandwidth)
        results.append(result)
        texts.append(text)
        log(f"batch {batch}: {result['step_us'] / 1e3:.3f} ms per step, bound {result['bound_us'] / 1e3:.3f} ms")
    with open(os.path.join(OUT, "decode_profile.txt"), "w") as handle:
        handle.write("\n\n".join(texts))
    with open(os.path.join(OUT, "decode_profile.json"), "w") as handle:
        json.dump({"bandwidth_TBps": bandwidth / 1e12, "results": results}, handle, indent=1)
    groups = sorted({name for r in results for name in r["groups"]}, key=lambda n: -results[-1]["groups"].get(n, {}).get("us", 0))
    print(f"decode step per kernel group (us per step, measured / bound), copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| group | " + " | ".join(f"batch {r['batch']}" for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for name in groups + ["step"]:
        cells = []
        for r in results:
            row = {"us": r["step_us"], "bound_us": r["bound_us"]} if name == "step" else r["groups"].get(name)
            if row is None:
                cells.append("-")
                continue
            bound = row["bound_us"]
            ratio = f" ({row['us'] / bound:.2f}x)" if bound else ""
            cells.append(f"{row['us']:.0f} / {bound:.0f}{ratio}" if bound is not None else f"{row['us']:.0f} / -")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("gemm bound: max(weights+activations / bandwidth, FLOPs / matmul rate): " +
          ", ".join(f"batch {r['batch']} {r['gemm_bytes_us']:.0f} / {r['gemm_compute_us']:.0f} us" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
