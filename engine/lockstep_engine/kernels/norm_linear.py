"""A decoder layer's residual add, RMSNorm and the projection after it in one Triton kernel, and the MLP's
SiLU-and-mul as the epilogue of its gate/up projection.

The unfused layer runs, per norm, the norm kernel (`fused.rms_norm`: read x and the residual, write the sum
and the normed row) and then the GEMM (read the normed row and the weight); the MLP adds a SiLU-and-mul
kernel between gate/up and down. In a small model's decode step these launches, not bytes, set the time
(SmolLM2-135M: 30 layers of about nine kernels each). Here:

* `norm_linear(x, residual, norm_weight, eps, weight)` returns `(y, h)`: `h = x + residual` (rounded to the
  dtype; `h = x` without a residual), `y = rms_norm(h) @ weight.T`. The normed row is never written: each
  program computes the row's mean square in a first pass over its x tile rows, then rebuilds the normed
  operand tile by tile, rounded exactly where `fused.rms_norm` rounds, in the second pass that feeds the dot.
* with `silu_mul=True`, `weight` is gate_up's `[2 * I, K]` (gate rows, then up rows) and `y` is
  `silu(gate) * up` `[tokens, I]`, each projection rounded to the dtype first as the unfused path's
  output is, then rounded as `fused.silu_and_mul` rounds.

So the operand of the dot is the unfused path's normed tensor, up to the order of the mean-square sum;
the dot itself accumulates in fp32 in another order than cuBLAS, so results agree within bf16 rounding,
not bit for bit (cuBLAS's own kernel, and so its order, changes with the token count too).

One program per (row block, column block); the program of column block 0 also writes `h`. No host sync,
outputs allocated from host shapes: the kernel can be captured in a CUDA graph. Bias and LoRA are not
handled here (the layer keeps the unfused path for them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bf16 dot operands as raw uint16 bits;
# there the dots run on fp32 copies of the same values instead.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if _INTERPRET:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        product = tl.dot(a, b, input_precision="ieee")  # fp32 models: no TF32
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _norm_linear_kernel(x_ptr, residual_ptr, norm_ptr, w_ptr, out_ptr, h_ptr, tokens, width, hidden, up_offset,
                        eps, stride_x, stride_r, stride_w, stride_out, stride_h,
                        HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < tokens
    col_mask = cols < width
    dtype = out_ptr.dtype.element_ty

    # pass 1: the rows' mean square (and h, written once by the first column block)
    square_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (ks < hidden)[None, :]
        h = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
            h = (h.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            if pid_n == 0:
                tl.store(h_ptr + rows[:, None] * stride_h + ks[None, :], h, mask=mask)
        hf = h.to(tl.float32)
        square_sum += tl.sum(hf * hf, axis=1)
    scale = tl.math.rsqrt(square_sum / hidden + eps)

    # pass 2: the normed operand, tile by tile, into the dot(s)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden
        mask = row_mask[:, None] & k_mask[None, :]
        h = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
            h = (h.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        normed = (h.to(tl.float32) * scale[:, None]).to(dtype)
        norm_weight = tl.load(norm_ptr + ks, mask=k_mask, other=0.0)
        operand = (norm_weight.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += _dot(operand, w, IEEE)
        if SILU_MUL:
            w_up = tl.load(w_ptr + (cols + up_offset)[None, :] * stride_w + ks[:, None], mask=w_mask, other=0.0)
            acc_up += _dot(operand, w_up, IEEE)

    out = acc.to(dtype)
    if SILU_MUL:
        gate = out.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        out = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def tiles(tokens: int, width: int, dtype: torch.dtype) -> dict:
    """Tile shape for a call. Decode-sized token counts get short row blocks (a block of 64 rows for 8
    tokens would compute 56 rows of nothing) and narrow column blocks (more programs for the few columns
    of a small model); fp32 (IEEE dots on FMA units) halves the tiles. Not tuned on a GPU yet."""
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    block_n = 32 if width <= 2048 or tokens <= 32 else 64
    if dtype == torch.float32:
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=2)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, silu_mul: bool = False, config: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [tokens, hidden] (rows may be strided, the last dim contiguous); norm_weight: [hidden];
    weight: [width, hidden] (`[2 * I, hidden]` with silu_mul). Returns (y, h): y [tokens, width] (or
    [tokens, I]) and h = x + residual (x itself without a residual), new tensors in x's dtype. `config`:
    a tile shape instead of `tiles()`'s (benchmarks/norm_linear_sweep.py)."""
    tokens, hidden = x.shape
    if weight.shape[1] != hidden or weight.stride(1) != 1:
        raise ValueError(f"weight must be [width, {hidden}] with contiguous rows, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    width = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    h = x
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        h = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens:
        config = config or tiles(tokens, width, x.dtype)
        grid = (triton.cdiv(tokens, config["BLOCK_M"]), triton.cdiv(width, config["BLOCK_N"]))
        source = residual if residual is not None else x
        _norm_linear_kernel[grid](
            x, source, norm_weight, weight, out, h, tokens, width, hidden, width if silu_mul else 0, eps,
            x.stride(0), source.stride(0), weight.stride(0), out.stride(0), h.stride(0),
            HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul, IEEE=x.dtype == torch.float32,
            enable_fp_fusion=False, **config)
    return out, h
