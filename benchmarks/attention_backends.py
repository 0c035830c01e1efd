"""The attention backends per phase on one GPU: Triton (and a few of its decode tile and split
settings) against FlashAttention-4 (`flash-attn-4`, when installed, with its split and GQA-packing
options), on the Llama-3-8B shape (32 query / 8 KV heads, head_dim 128) and SmolLM2-135M's (9 / 3, 64),
bf16, block size 16.

* decode: `--batches` rows at `--context` tokens each, timed as CUDA-graph replays of one layer's
  attention (the cache already written), against its byte bound (KV read once, q read and out written
  once) at the measured copy bandwidth;
* prefill: one chunk of each of `--chunks` tokens without context, and a mixed step (a 2048-token
  chunk plus 256 decode rows), against the larger of the FLOP bound (causal, `--matmul-tflops`) and
  the byte bound.
Each variant's output is checked against the default Triton backend's (max abs difference, printed).
Prints one table per phase; the numbers go to $OUT/attention_backends.json. `auto`'s table
(attention_backends.AUTO_BY_PHASE) is set from this.

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/attention_backends.py        # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton.testing

from decode_profile import copy_bandwidth
from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.kernels.triton_attention import TritonPagedAttention

OUT = os.environ.get("OUT", ".bench")
SHAPES = {"llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
BLOCK = 16


def log(message: str) -> None:
    print(f"[attention_backends] {message}", file=sys.stderr, flush=True)


class TunedTriton(TritonPagedAttention):
    """The Triton backend with its decode tile overridden (block_n keys per tile, warps, pipeline stages)."""

    def __init__(self, *shape, block_n: int, warps: int, stages: int = 3, decode_splits=None):
        super().__init__(*shape, decode_splits=decode_splits)
        self.block_n, self.warps, self.stages = block_n, warps, stages

    def tiles(self, dtype):
        return super().tiles(dtype) | {"decode_block_n": self.block_n, "decode_warps": self.warps,
                                       "decode_stages": self.stages}


SWEEP = ""  # "tiles" (--decode-sweep): the whole tile grid below; "splits" (--split-sweep): split counts


def sweep_variants(shape) -> dict:
    """Every decode tile of block_n x warps x stages, unsplit and at 2 and 4 splits."""
    out = {"triton": lambda: TritonPagedAttention(*shape, BLOCK)}
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                for splits in (1, 2, 4):
                    out[f"n{block_n} w{warps} s{stages} x{splits}"] = (
                        lambda b=block_n, w=warps, st=stages, x=splits:
                        TunedTriton(*shape, BLOCK, block_n=b, warps=w, stages=st, decode_splits=x))
    return out


def split_variants(shape) -> dict:
    """The default tile at fixed split counts (where the split heuristic's threshold should lie)."""
    out = {"triton": lambda: TritonPagedAttention(*shape, BLOCK)}
    for splits in (1, 2, 3, 4, 6, 8):
        out[f"x{splits}"] = lambda x=splits: TritonPagedAttention(*shape, BLOCK, decode_splits=x)
    return out


def variants(shape, phase: str) -> dict:
    """name -> a backend factory, the default Triton backend first."""
    if SWEEP == "splits":
        return split_variants(shape)
    if SWEEP == "tiles":
        return sweep_variants(shape)
    out = {"triton": lambda: TritonPagedAttention(*shape, BLOCK)}
    if phase == "decode":
        for block_n, warps in ((32, 4), (128, 4), (64, 8)):
            out[f"triton n{block_n} w{warps}"] = lambda b=block_n, w=warps: TunedTriton(*shape, BLOCK, block_n=b, warps=w)
        for splits in (2, 4):
            out[f"triton splits {splits}"] = lambda s=splits: TritonPagedAttention(*shape, BLOCK, decode_splits=s)
    try:
        from lockstep_engine.kernels.flash_attention import FlashAttnPagedAttention, load_flash_attn

        load_flash_attn()
    except ImportError as error:
        log(f"flash-attn unavailable: {error}")
        return out
    out["flash-attn"] = lambda: FlashAttnPagedAttention(*shape, BLOCK)
    out["flash-attn pack_gqa"] = lambda: FlashAttnPagedAttention(*shape, BLOCK, pack_gqa=True)
    if phase == "decode":
        out["flash-attn splits auto"] = lambda: FlashAttnPagedAttention(*shape, BLOCK, num_splits=0)
    return out


def make_step(shape, rows: list[tuple[int, int]], decode: bool, seed: int):
    """q, caches and metadata for one layer's step of `rows` (context, new tokens), random contents."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tables, slots, starts, next_block = [], [], [0], 0
    for context, new in rows:
        blocks = -(-(context + new) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        slots += [tables[-1][p // BLOCK] * BLOCK + p % BLOCK for p in range(context, context + new)]
        starts.append(starts[-1] + new)
    width = max(map(len, tables))
    table = torch.tensor([t + [next_block] * (width - len(t)) for t in tables], device="cuda")
    cache_shape = (next_block + 1, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(cache_shape, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn((starts[-1], heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
    seq_lens = [c + n for c, n in rows]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"), block_tables=table,
        seq_lens=torch.tensor(seq_lens, device="cuda"),
        query_start_loc=None if decode else torch.tensor(starts, device="cuda"),
        query_start_loc_host=starts, seq_lens_host=seq_lens, max_seq_len=width * BLOCK)
    return q, k_cache, v_cache, meta


def bound_us(shape, rows, bandwidth: float, flops_per_s: float) -> float:
    heads, kv_heads, head_dim = shape
    tokens = sum(n for _, n in rows)
    size = 2 * (sum(2 * kv_heads * head_dim * (c + n) for c, n in rows) + 2 * tokens * heads * head_dim)
    flops = 4 * heads * head_dim * sum(n * c + n * (n + 1) // 2 for c, n in rows)
    return max(size / bandwidth, flops / flops_per_s) * 1e6


def measure(phase: str, shape, cases: dict, bandwidth: float, flops_per_s: float, deadline: float) -> dict:
    results = {}
    for case, rows in cases.items():
        q, k_cache, v_cache, meta = make_step(shape, rows, phase == "decode", seed=len(rows))
        bound = bound_us(shape, rows, bandwidth, flops_per_s)
        reference = None
        for name, factory in variants(shape, phase).items():
            if time.monotonic() > deadline:
                log(f"out of time: skipped {case} {name}")
                continue
            try:
                backend = factory()
                run = lambda: backend.attend(q, k_cache, v_cache, meta)  # noqa: E731
                out = run()  # compiles
                torch.cuda.synchronize()
                if phase == "decode":
                    us = triton.testing.do_bench_cudagraph(run, rep=20 if SWEEP else 50, return_mode="median") * 1e3
                else:
                    us = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3
            except Exception as error:  # a variant that fails to build or run is reported, not fatal
                log(f"{case} {name}: {type(error).__name__}: {error}")
                results.setdefault(case, {})[name] = {"error": f"{type(error).__name__}: {error}"}
                continue
            if reference is None:
                reference = out.float()
            diff = float((out.float() - reference).abs().max())
            results.setdefault(case, {})[name] = {"us": us, "bound_us": bound, "max_abs_diff": diff}
            log(f"{case} {name}: {us:.1f} us, bound {bound:.1f} us ({us / bound:.2f}x), max |diff| {diff:.2e}")
    return results


def print_table(title: str, results: dict) -> None:
    names = list(dict.fromkeys(n for r in results.values() for n in r))
    print(f"\n{title}: us measured / bound (ratio), max |diff| to triton")
    print("| backend | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for name in names:
        cells = []
        for r in results.values():
            cell = r.get(name)
            if cell is None:
                cells.append("-")
            elif "error" in cell:
                cells.append("error")
            else:
                cells.append(f"{cell['us']:.1f} / {cell['bound_us']:.1f} ({cell['us'] / cell['bound_us']:.2f}x), "
                             f"{cell['max_abs_diff']:.0e}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_sweep(title: str, results: dict, top: int = 6) -> None:
    """Per case: the default and the fastest `top` tiles."""
    print(f"\n{title}: the default and the fastest decode tiles, us measured / bound (ratio)")
    for case, cells in results.items():
        timed = sorted((cell["us"], name) for name, cell in cells.items()
                       if "us" in cell and cell["max_abs_diff"] < 2e-2)  # a wrong tile is no candidate
        default = cells.get("triton", {})
        bound = default.get("bound_us", float("nan"))
        line = [f"default {default.get('us', float('nan')):.1f}"]
        line += [f"{name} {us:.1f} ({us / bound:.2f}x)" for us, name in timed[:top]]
        print(f"| {case} (bound {bound:.1f}) | " + " | ".join(line) + " |")


def main() -> int:
    global SWEEP
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--context", type=int, default=330)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--matmul-tflops", type=float, default=790.0)
    parser.add_argument("--budget", type=float, default=200.0, help="seconds; later variants are skipped past it")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="decode only, every tile of block_n x warps x stages x splits; prints the fastest")
    parser.add_argument("--split-sweep", action="store_true",
                        help="decode only, the default tile at 1-8 splits; prints the fastest per case")
    args = parser.parse_args()
    SWEEP = "splits" if args.split_sweep else "tiles" if args.decode_sweep else ""
    deadline = time.monotonic() + args.budget
    os.makedirs(OUT, exist_ok=True)
    bandwidth = copy_bandwidth("cuda")
    flops_per_s = args.matmul_tflops * 1e12
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    decode_cases = {f"batch {b}": [(args.context, 1)] * b for b in args.batches}
    prefill_cases = {f"chunk {n}": [(0, n)] for n in args.chunks}
    prefill_cases["2048 + 256 decode"] = [(0, 2048)] + [(args.context, 1)] * 256
    report = {"bandwidth_TBps": bandwidth / 1e12}
    with torch.inference_mode():
        for model, shape in SHAPES.items():
            report[f"{model} decode"] = measure("decode", shape, decode_cases, bandwidth, flops_per_s, deadline)
            if model == "llama-3-8b" and not SWEEP:
                report[f"{model} prefill"] = measure("prefill", shape, prefill_cases, bandwidth, flops_per_s,
                                                     deadline)
    with open(os.path.join(OUT, "attention_backends.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    for title, results in report.items():
        if title != "bandwidth_TBps":
            (print_sweep if SWEEP else print_table)(title, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
