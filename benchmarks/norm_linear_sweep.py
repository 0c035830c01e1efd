"""`kernels/norm_linear.py` against the unfused layer it replaces, per projection, at decode batch sizes: the
fused add + RMSNorm + projection (and SiLU-and-mul for gate/up) at each tile shape of a small sweep, and
`fused.rms_norm` + `F.linear` (+ `fused.silu_and_mul`), cuBLAS's choice, as the engine runs them unfused.

Each case is timed as CUDA-graph replays (20 calls a graph, median of `--repeats` graphs), so launch
overhead on the host does not count; what a launch costs on the device does. Prints, per model, shape and
batch, the unfused time, the default tile's time and the fastest tile's; the numbers go to
$OUT/norm_linear_sweep.json. The per-step total over a model's layers is what the engine would gain.

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/norm_linear_sweep.py                # on a GPU
    PYTHONPATH=$PWD:$PWD/engine python benchmarks/norm_linear_sweep.py --quick        # the default tiles only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

from gemm_backends import graph_seconds  # benchmarks/ is on sys.path when run as a script
from lockstep_engine.kernels import fused
from lockstep_engine.kernels.norm_linear import norm_linear, tiles

OUT = os.environ.get("OUT", ".bench")
# model: hidden size, layers, {projection: (width, SiLU-and-mul)}; widths as the engine loads them (fused)
MODELS = {
    "smollm2-135m": (576, 30, {"qkv": (960, False), "gate_up": (1536, True)}),
    "llama-3-8b": (4096, 32, {"qkv": (6144, False), "gate_up": (14336, True)}),
}
EPS = 1e-5


def log(message: str) -> None:
    print(f"[norm_linear_sweep] {message}", file=sys.stderr, flush=True)


def sweep_configs(default: dict, quick: bool):
    """About 20 tiles around the default's row block: column and reduction blocks, pipeline stages, and 8 warps
    for the widest column block (each new shape compiles once per kernel variant, about a second)."""
    if quick:
        return
    for block_n, block_k, stages in itertools.product((32, 64, 128), (64, 128), (2, 3, 4)):
        for warps in ((4, 8) if block_n == 128 else (4,)):
            yield dict(BLOCK_M=default["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 128, 256])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="the default tiles only, no sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("norm_linear_sweep.py times CUDA graphs: it needs a GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows, totals = [], {}
    for model in args.models:
        hidden, layers, projections = MODELS[model]
        for (name, (width, silu_mul)), batch in itertools.product(projections.items(), args.batches):
            gen = torch.Generator(device="cpu").manual_seed(batch)
            x = torch.randn(batch, hidden, generator=gen).to(device, dtype)
            residual = torch.randn(batch, hidden, generator=gen).to(device, dtype)
            norm_weight = torch.ones(hidden, device=device, dtype=dtype)
            weight = (torch.randn(2 * width if silu_mul else width, hidden, generator=gen) * hidden ** -0.5).to(
                device, dtype)

            def unfused():
                normed, _ = fused.rms_norm(x, norm_weight, EPS, residual)
                y = F.linear(normed, weight)
                return fused.silu_and_mul(y) if silu_mul else y

            base = graph_seconds(unfused, args.repeats)
            default = tiles(batch, width, dtype)
            default_s = graph_seconds(lambda: norm_linear(x, residual, norm_weight, EPS, weight, silu_mul), args.repeats)
            expected = unfused().float()
            best, best_s = default, default_s
            for config in sweep_configs(default, args.quick):
                try:
                    out, _ = norm_linear(x, residual, norm_weight, EPS, weight, silu_mul, config=config)
                    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
                    seconds = graph_seconds(lambda: norm_linear(x, residual, norm_weight, EPS, weight, silu_mul,
                                                             config=config), args.repeats)
                except Exception as error:  # a tile that does not fit the shared memory, say
                    log(f"{model} {name} {batch}: {config} skipped ({type(error).__name__})")
                    continue
                if seconds < best_s:
                    best, best_s = config, seconds
            row = {"model": model, "projection": name, "batch": batch, "unfused_us": base * 1e6,
                   "default_us": default_s * 1e6, "best_us": best_s * 1e6, "best": best, "default": default}
            rows.append(row)
            totals.setdefault((model, batch), [0.0, 0.0, 0.0])
            for i, value in enumerate((base, default_s, best_s)):
                totals[(model, batch)][i] += value * layers * 1e6
            log(f"{model} {name} batch {batch}: unfused {base * 1e6:.1f} us, default {default_s * 1e6:.1f}, "
                f"best {best_s * 1e6:.1f} {best}")
    print("| model | projection | batch | unfused µs | fused, default tile µs | fused, fastest tile µs | fastest tile |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        best = row["best"]
        print(f"| {row['model']} | {row['projection']} | {row['batch']} | {row['unfused_us']:.1f} | "
              f"{row['default_us']:.1f} | {row['best_us']:.1f} | {best['BLOCK_M']}/{best['BLOCK_N']}/{best['BLOCK_K']} "
              f"w{best['num_warps']} s{best['num_stages']} |")
    print("\n| model | batch | per step unfused µs | fused default | fused fastest |")
    print("|---|---|---|---|---|")
    for (model, batch), (base, default_s, best_s) in totals.items():
        print(f"| {model} | {batch} | {base:.0f} | {default_s:.0f} | {best_s:.0f} |")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "norm_linear_sweep.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
