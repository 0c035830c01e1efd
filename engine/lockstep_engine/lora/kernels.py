"""Grouped LoRA kernels in Triton: the tokens of each adapter slot gathered into tiles, one matmul per tile.

A batch mixing adapters is first grouped by slot on the device (`group`: a stable counting sort,
one program per slot, no host sync), so every later kernel reads an adapter's A or B tile once per
BLOCK_M tokens of that adapter instead of once per token (what a per-token gather kernel, punica's
bgmv, does; at 256 decode rows and rank 16 on Llama-3-8B's seven targets that is about 21 GB of cache
reads per step). Slot 0 is the base model: its tokens are in no tile and cost nothing. The grid is
sized for the worst case (every token in one slot), and programs past their slot's count return at
once, so the launches are the same for every batch of a size and can be captured in a CUDA graph.

* `group(slots, num_slots)` -> `Groups`: token indices ordered by slot, each slot's count and start.
* `shrink(x, a, groups)` -> h partials [split, tokens, n] float32: h = x[t] @ A[slot(t)]^T, the K
  reduction split over `split` programs per tile for parallelism at decode sizes, summed by `expand`
  in a fixed order (no atomics: the same inputs give the same bits).
* `expand(h, b, groups, y, slices)`: y[t] += h[t] @ B[slot(t)]^T in place, in y's dtype; each
  sub-projection of a packed layer (q, k, v / gate, up) reads its own rank columns of h, in one
  launch when every slice boundary falls on a tile boundary.

Rows of h for slot-0 tokens are never written and never read.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Groups(NamedTuple):
    order: torch.Tensor  # [tokens] int32: token indices, slot 1's first, in their original order within a slot
    counts: torch.Tensor  # [num_slots] int32: tokens per slot (slot 0's is not filled)
    starts: torch.Tensor  # [num_slots] int32: each slot's first position in `order`
    tokens: int
    num_slots: int


@triton.jit
def _group_kernel(slots_ptr, order_ptr, counts_ptr, starts_ptr, T, BLOCK: tl.constexpr):
    slot = tl.program_id(0) + 1  # slot 0 (the base model) is grouped by no one
    start = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for t0 in range(0, T, BLOCK):  # the tokens of lower slots go first
        offs = t0 + tl.arange(0, BLOCK)
        values = tl.load(slots_ptr + offs, mask=offs < T, other=slot)
        start += tl.sum((values < slot).to(tl.int32), axis=0)
    position = start
    for t0 in range(0, T, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        hit = (tl.load(slots_ptr + offs, mask=offs < T, other=-1) == slot).to(tl.int32)
        tl.store(order_ptr + position + tl.cumsum(hit, axis=0) - 1, offs.to(tl.int32), mask=hit == 1)
        position += tl.sum(hit, axis=0)
    tl.store(counts_ptr + slot, position - start)
    tl.store(starts_ptr + slot, start)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, order_ptr, counts_ptr, starts_ptr, out_ptr, N, K, K_PER_SPLIT,
                   stride_x, stride_a_slot, stride_a_row, stride_out_split, stride_out,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    slot = tl.program_id(2) // ((K + K_PER_SPLIT - 1) // K_PER_SPLIT) + 1
    split = tl.program_id(2) % ((K + K_PER_SPLIT - 1) // K_PER_SPLIT)
    count = tl.load(counts_ptr + slot)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tokens = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum((split + 1) * K_PER_SPLIT, K)
    for k0 in range(split * K_PER_SPLIT, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = tl.load(a_base + offs_n[None, :] * stride_a_row + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out = out_ptr + split * stride_out_split + tokens[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, y_ptr, N, R, SPLITS, OFF1, OFF2,
                   stride_h_split, stride_h, stride_b_slot, stride_b_row, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    slot = tl.program_id(2) + 1
    count = tl.load(counts_ptr + slot)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tokens = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    sub = (n0 >= OFF1).to(tl.int32) + (n0 >= OFF2).to(tl.int32)  # the tile's sub-projection: its rank columns
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    h_rows = h_ptr + tokens[:, None] * stride_h + sub * R + offs_r[None, :]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(0, SPLITS):
        h += tl.load(h_rows + split * stride_h_split, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + offs_n[None, :] * stride_b_row + offs_r[:, None],
                mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    h = h.to(w.dtype)
    if UPCAST:
        h, w = h.to(tl.float32), w.to(tl.float32)
    delta = tl.dot(h, w, input_precision=PRECISION)
    y_tile = y_ptr + tokens[:, None] * stride_y + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # float32 stays exact; bf16/fp16 ignore it


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the dot's 16-bit operands go in as float32: only under Triton's CPU interpreter, whose dot
    reads bfloat16 operands wrongly (tests run there; a GPU multiplies them on its tensor cores)."""
    return dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"


def _block_m(tokens: int) -> int:
    return 16 if tokens <= 128 else 32 if tokens <= 1024 else 64


def group(slots: torch.Tensor, num_slots: int) -> Groups:
    """slots: [tokens] int64 slot per token (0..num_slots-1) -> the tokens of each slot 1.. in order."""
    tokens = slots.shape[0]
    order = torch.empty(max(tokens, 1), dtype=torch.int32, device=slots.device)
    counts = torch.zeros(num_slots, dtype=torch.int32, device=slots.device)
    starts = torch.zeros(num_slots, dtype=torch.int32, device=slots.device)
    if tokens and num_slots > 1:
        _group_kernel[(num_slots - 1,)](slots, order, counts, starts, tokens,
                                        BLOCK=max(16, min(triton.next_power_of_2(tokens), 1024)))
    return Groups(order, counts, starts, tokens, num_slots)


def shrink(x: torch.Tensor, a: torch.Tensor, groups: Groups) -> torch.Tensor:
    """x: [tokens, K]; a: [slots, N, K] (last dim contiguous) -> partial sums [split, tokens, N] float32."""
    tokens, size_k = x.shape
    size_n = a.shape[1]
    assert a.stride(2) == 1 and x.stride(1) == 1
    block_m = _block_m(tokens)
    block_k = 64
    # at decode sizes few tiles have tokens: split K so that enough programs run; a prefill needs no split
    splits = max(1, min(triton.cdiv(size_k, 256), 2048 // max(tokens, 1)))
    k_per_split = triton.cdiv(triton.cdiv(size_k, splits), block_k) * block_k
    splits = triton.cdiv(size_k, k_per_split)
    out = torch.empty(splits, tokens, size_n, dtype=torch.float32, device=x.device)
    if tokens == 0 or groups.num_slots < 2:
        return out
    block_n = max(16, min(triton.next_power_of_2(size_n), 64))
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(size_n, block_n), (groups.num_slots - 1) * splits)
    _shrink_kernel[grid](x, a, groups.order, groups.counts, groups.starts, out, size_n, size_k, k_per_split,
                         x.stride(0), a.stride(0), a.stride(1), out.stride(0), out.stride(1),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x.dtype),
                         UPCAST=_upcast(x.dtype))
    return out


def _tile(sizes: list[int]) -> int:
    """The widest output tile (16..128) on which every slice boundary falls; 0 if there is none."""
    for block_n in (128, 64, 32, 16):
        if all(size % block_n == 0 for size in sizes[:-1]):
            return block_n
    return 0


def expand(h: torch.Tensor, b: torch.Tensor, groups: Groups, y: torch.Tensor,
           slices: tuple[tuple[int, int], ...]) -> None:
    """h: [split, tokens, len(slices) * R] float32 partials; b: [slots, N, R]; y: [tokens, N] (rows may be
    strided), added to in place. Slice i = (offset, size) of y's columns reads h's columns i*R..(i+1)*R."""
    splits, tokens, _ = h.shape
    rank = b.shape[-1]
    if tokens == 0 or groups.num_slots < 2:
        return
    assert h.stride(2) == 1 and b.stride(2) == 1 and y.stride(1) == 1 and len(slices) <= 3
    block_m = _block_m(tokens)
    block_r = max(16, triton.next_power_of_2(rank))
    sizes = [size for _, size in slices]
    block_n = _tile(sizes)
    if block_n:  # one launch for every slice
        parts = [(0, sum(sizes), [offset for offset, _ in slices[1:]])]
    else:  # a slice boundary inside a tile: one launch per slice
        block_n = 16
        parts = [(offset, size, []) for offset, size in slices]
    for index, (offset, size, bounds) in enumerate(parts):
        off1, off2 = (bounds + [size, size])[:2]
        grid = (triton.cdiv(tokens, block_m), triton.cdiv(size, block_n), groups.num_slots - 1)
        _expand_kernel[grid](h[:, :, index * rank:], b[:, offset:], groups.order, groups.counts, groups.starts,
                             y[:, offset:], size, rank, splits, off1, off2, h.stride(0), h.stride(1), b.stride(0),
                             b.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                             PRECISION=_precision(b.dtype), UPCAST=_upcast(b.dtype))
