"""Fused elementwise kernels against the torch ops they replace, on the GPU. A script, not a test.

    python tests/kernels/bench_fused.py

Llama-3-8B shape (hidden 4096, intermediate 14336, 32 query heads, 8 KV heads, head_dim 128), bf16.
Per kernel and token count: the torch ops of layers.py (eager) and the fused kernel, times from
triton.testing.do_bench (L2 flushed between calls), and the fused kernel's GB/s over the bytes it
must move. "layer" is one decoder layer's share: two residual-add norms, SiLU-and-mul and rotary.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "engine"))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from lockstep_engine.kernels import fused  # noqa: E402
from lockstep_engine.layers import RMSNorm, RotaryEmbedding, _rotate_half  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DTYPE = torch.bfloat16
ELEM = 2
TOKENS = (4, 256, 4096, 16384)


def torch_add_norm(norm: RMSNorm, x, residual):
    h = x + residual
    return norm._norm(h), h


def torch_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rotary(rotary: RotaryEmbedding, positions, q, k):
    cos = rotary.cos[positions].unsqueeze(1).to(q.dtype)
    sin = rotary.sin[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def cases(tokens: int, device):
    norm = RMSNorm(HIDDEN, 1e-5).to(device=device, dtype=DTYPE)
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 500000.0, None).to(device)
    x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=device)
    residual = torch.randn_like(x)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=DTYPE, device=device)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=device)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    qk_bytes = 2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * ELEM + tokens * HEAD_DIM * 8
    return {
        "add+rms_norm": (lambda: torch_add_norm(norm, x, residual),
                         lambda: fused.rms_norm(x, norm.weight, norm.eps, residual), 4 * tokens * HIDDEN * ELEM),
        "silu_and_mul": (lambda: torch_silu_and_mul(gate_up), lambda: fused.silu_and_mul(gate_up),
                         3 * tokens * INTERMEDIATE * ELEM),
        "rotary": (lambda: torch_rotary(rotary, positions, q, k),
                   lambda: fused.rotary(positions, q, k, rotary.cos, rotary.sin), qk_bytes),
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_fused.py needs a CUDA GPU")
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"Llama-3-8B shape, {DTYPE}")
    print(f"{'tokens':>6} {'op':>13} {'torch us':>9} {'fused us':>9} {'speedup':>7} {'fused GB/s':>10}")
    for tokens in TOKENS:
        torch_layer = fused_layer = 0.0
        for name, (torch_fn, fused_fn, moved) in cases(tokens, device).items():
            torch_ms = do_bench(torch_fn, warmup=10, rep=50)
            fused_ms = do_bench(fused_fn, warmup=10, rep=50)
            count = 2 if name == "add+rms_norm" else 1
            torch_layer += count * torch_ms
            fused_layer += count * fused_ms
            print(f"{tokens:6d} {name:>13} {torch_ms * 1e3:9.1f} {fused_ms * 1e3:9.1f} {torch_ms / fused_ms:6.1f}x "
                  f"{moved / fused_ms / 1e6:10.0f}")
        print(f"{tokens:6d} {'layer':>13} {torch_layer * 1e3:9.1f} {fused_layer * 1e3:9.1f} "
              f"{torch_layer / fused_layer:6.1f}x")
        torch.cuda.empty_cache()
    print("(GB/s = bytes the fused kernel must read and write / its time; the H200's copy rate is ~4.3 TB/s)")


if __name__ == "__main__":
    main()
