"""The decode step's matmuls on their own: each Llama-3-8B projection at decode batch sizes, through
cuBLAS (torch's default) and cuBLASLt (`torch.backends.cuda.preferred_blas_library`), against its bound
(weights read once at the measured copy bandwidth, or its FLOPs at `--matmul-tflops`, whichever is
longer). Each case is timed as CUDA-graph replays of `F.linear` (no launch overhead), median of
`--repeats` graphs of 20 calls. Prints one table per backend; the numbers go to $OUT/gemm_backends.json.

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/gemm_backends.py            # on the H200
    PYTHONPATH=$PWD:$PWD/engine python benchmarks/gemm_backends.py --device cpu --batches 1 4 --shapes o   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from decode_profile import copy_bandwidth  # benchmarks/ is on sys.path when run as a script

OUT = os.environ.get("OUT", ".bench")
# name: (in features, out features) of random:llama-3-8b, q/k/v and gate/up fused as the engine loads them
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
LAYER_COUNTS = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def log(message: str) -> None:
    print(f"[gemm_backends] {message}", file=sys.stderr, flush=True)


def time_linear(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    """Seconds per F.linear(x, w)."""
    if x.device.type != "cuda":
        calls = 20
        started = time.perf_counter()
        for _ in range(calls):
            F.linear(x, w)
        return (time.perf_counter() - started) / calls
    return graph_seconds(lambda: F.linear(x, w), repeats)


def graph_seconds(fn, repeats: int, calls: int = 20) -> float:
    """Seconds per fn() as CUDA-graph replays (warmed up on a side stream, then `calls` calls a graph, median
    of `repeats` replays), so the host's launch overhead does not count."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--backends", nargs="+", default=["cublas", "cublaslt"])
    parser.add_argument("--matmul-tflops", type=float, default=790.0)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device.type)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    weights = {name: torch.randn(SHAPES[name][1], SHAPES[name][0], dtype=dtype, device=device) * 0.02
               for name in args.shapes}
    rows = []
    for backend in args.backends:
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library(backend)
        for batch in args.batches:
            step_us = bound_step_us = 0.0
            for name in args.shapes:
                w = weights[name]
                x = torch.randn(batch, w.shape[1], dtype=dtype, device=device)
                seconds = time_linear(x, w, args.repeats)
                nbytes = w.numel() * w.element_size() + (x.numel() + batch * w.shape[0]) * x.element_size()
                bound = max(nbytes / bandwidth, 2 * batch * w.numel() / (args.matmul_tflops * 1e12))
                rows.append({"backend": backend, "batch": batch, "shape": name, "us": seconds * 1e6,
                             "bound_us": bound * 1e6, "gb_s": nbytes / seconds / 1e9})
                step_us += seconds * 1e6 * LAYER_COUNTS[name]
                bound_step_us += bound * 1e6 * LAYER_COUNTS[name]
            rows.append({"backend": backend, "batch": batch, "shape": "step", "us": step_us, "bound_us": bound_step_us})
            log(f"{backend} batch {batch}: {step_us:.0f} us per step's GEMMs ({step_us / bound_step_us:.2f}x)")
    names = args.shapes + ["step"]
    for backend in args.backends:
        print(f"\n{backend}: us per call, measured / bound (step: the 32 layers and lm_head)\n")
        print("| batch | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for batch in args.batches:
            cells = []
            for name in names:
                row = next(r for r in rows if r["backend"] == backend and r["batch"] == batch and r["shape"] == name)
                cells.append(f"{row['us']:.1f} / {row['bound_us']:.1f} ({row['us'] / row['bound_us']:.2f}x)")
            print(f"| {batch} | " + " | ".join(cells) + " |")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gemm_backends.json"), "w") as handle:
        json.dump({"copy_bandwidth": bandwidth, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
