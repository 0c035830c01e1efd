"""The LoRA term's cost per decoder layer against the layer's base GEMMs, on CUDA (Llama-3-8B shapes, bf16).

For each token count, the seven targets' LoRA terms of one layer (q/k/v packed, o, gate/up packed, down;
rank 16, four adapters, tokens spread over them round robin, `--base-share` of them on the base model)
through the grouped Triton kernels, against the same layer's four base GEMMs; CUDA events over
`--iters` replays of a CUDA graph of each (so launch gaps count as they do in the engine's decode
graphs). Prints a markdown table; the engine's decode steps are graph replays of 32 such layers.

    python3 benchmarks/lora_kernels.py                 # on a GPU
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))

from lockstep_engine.lora import kernels  # noqa: E402
from lockstep_engine.lora.ops import add_lora_grouped  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def graph_time(fn, iters: int) -> float:
    """Microseconds per call of `fn`, replayed as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 2048, 8192])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--base-share", type=float, default=0.0)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    dev, dtype, rank, slots_n = torch.device("cuda"), torch.bfloat16, args.rank, args.adapters + 1
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    targets = {  # name: (in, slices of the output)
        "qkv": (HIDDEN, ((0, q), (q, kv), (q + kv, kv))),
        "o": (q, ((0, HIDDEN),)),
        "gate_up": (HIDDEN, ((0, INTER), (INTER, INTER))),
        "down": (INTER, ((0, HIDDEN),)),
    }
    weights = {}
    for name, (size_in, slices) in targets.items():
        size_out = sum(size for _, size in slices)
        a = torch.randn(slots_n, len(slices) * rank, size_in, device=dev, dtype=dtype) * 0.01
        b = torch.randn(slots_n, size_out, rank, device=dev, dtype=dtype) * 0.01
        a[0], b[0] = 0, 0
        w = torch.randn(size_out, size_in, device=dev, dtype=dtype) * 0.01
        weights[name] = (a, b, w, slices)
    print(f"LoRA term per decoder layer, Llama-3-8B shapes, bf16, rank {rank}, {args.adapters} adapters, "
          f"base share {args.base_share:.0%}; CUDA-graph replays, {torch.cuda.get_device_name()}")
    print("| tokens | base GEMMs µs | LoRA µs (qkv / o / gate_up / down) | LoRA total µs | LoRA / base |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for tokens in args.tokens:
            slots = torch.arange(tokens, device=dev) % args.adapters + 1
            slots[: int(tokens * args.base_share)] = 0
            xs = {name: torch.randn(tokens, targets[name][0], device=dev, dtype=dtype) for name in targets}
            ys = {name: torch.empty(tokens, weights[name][2].shape[0], device=dev, dtype=dtype) for name in targets}
            base = sum(graph_time(lambda n=name: torch.matmul(xs[n], weights[n][2].t(), out=ys[n]), args.iters)
                       for name in targets)
            group = graph_time(lambda: kernels.group(slots, slots_n), args.iters)
            per = {}
            for name in targets:
                a, b, _, slices = weights[name]
                groups = kernels.group(slots, slots_n)
                per[name] = graph_time(lambda n=name, a=a, b=b, s=slices, g=groups:
                                       add_lora_grouped(xs[n], ys[n], a, b, g, s), args.iters)
            total = group / 32 + sum(per.values())  # one grouping per forward, shared by the 32 layers
            print(f"| {tokens} | {base:.0f} | {' / '.join(f'{per[n]:.0f}' for n in targets)} (grouping {group:.0f} a forward) "
                  f"| {total:.0f} | {total / base:.1%} |")


if __name__ == "__main__":
    main()
