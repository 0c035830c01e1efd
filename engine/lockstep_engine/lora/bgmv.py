"""Batched gather matrix-vector LoRA kernels in Triton (punica's bgmv, as vLLM uses it).

Each token reads its slot from `slots` on the device and gathers that slot's A or B rows: a batch
mixing adapters (and the base model, slot 0, whose rows are zeros) is one launch per kernel, with
no host sync and no allocation but the shrink output, so both kernels can be captured in a CUDA
graph. One program per token and output tile; the reduction runs in float32.

* `shrink`: h[t] = x[t] @ A[slots[t]]^T  -> [tokens, n] float32
* `expand`: y[t] += h[t] @ B[slots[t]]^T (y updated in place, in its own dtype; y may be a column
  slice of a wider output, so each packed sub-projection writes its own columns)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, N, K, stride_x, stride_a_slot, stride_a_row, stride_out,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + token * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(a_ptr + slot * stride_a_slot + offs_n[:, None] * stride_a_row + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_out + offs_n, acc, mask=mask_n)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, R, stride_h, stride_b_slot, stride_b_row, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    h = tl.load(h_ptr + token * stride_h + offs_r, mask=mask_r, other=0.0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w = tl.load(b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_row + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(w * h[None, :], axis=1)
    y = tl.load(y_ptr + token * stride_y + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * stride_y + offs_n, (y + delta).to(y_ptr.dtype.element_ty), mask=mask_n)


def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [tokens, K]; a: [slots, N, K] (last dim contiguous); slots: [tokens] int64 -> [tokens, N] float32."""
    tokens, size_k = x.shape
    size_n = a.shape[1]
    x = x.contiguous()
    out = torch.empty(tokens, size_n, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    block_n = min(triton.next_power_of_2(size_n), 32)
    block_k = min(triton.next_power_of_2(size_k), 256)
    assert a.stride(2) == 1
    _shrink_kernel[(tokens, triton.cdiv(size_n, block_n))](
        x, a, slots, out, size_n, size_k, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    """h: [tokens, R] float32; b: [slots, N, R]; y: [tokens, N] (rows may be strided), added to in place."""
    tokens, rank = h.shape
    size_n = b.shape[1]
    if tokens == 0:
        return
    assert h.stride(1) == 1 and b.stride(2) == 1 and y.stride(1) == 1
    block_n = min(triton.next_power_of_2(size_n), 128)
    _expand_kernel[(tokens, triton.cdiv(size_n, block_n))](
        h, b, slots, y, size_n, rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank))
