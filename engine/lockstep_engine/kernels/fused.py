"""Fused elementwise kernels of the Llama decoder in Triton: RMSNorm (with the residual add),
SiLU-and-mul, rotary embedding (alone, or with the KV-cache write), and greedy sampling.

Each replaces a chain of small torch kernels with one launch and one pass over memory, and rounds
where the torch code in `layers.py` rounds, so bf16 results match it up to the order of the
RMSNorm sum (fp32 results match up to that and fp32 rounding of exp/rsqrt):

* `rms_norm`: `weight * (h.float() * rsqrt(mean(h.float() ** 2) + eps)).to(dtype)`, with
  `h = x + residual` rounded to the dtype first when a residual is given.
* `silu_and_mul`: `silu(gate)` rounded to the dtype, times `up`, rounded.
* `rotary`: `q * cos + rotate_half(q) * sin` with cos and sin rounded to the dtype, each product
  rounded, then the sum rounded (same for k).
* `rotary_write_kv`: the same rotation of q and k, in one launch with the paged KV-cache write: the
  rotated k and the untouched v go straight from the qkv projection's output to their cache slots
  (what `rotary` followed by `TorchPagedAttention.write_kv` stores, bit for bit).
* `greedy_sample`: the sampler's greedy tail, `argmax(logits)` with the stop tokens banned for rows
  below their `min_tokens`, read once from the logits in their own dtype (no float32 copy).

Every launch passes enable_fp_fusion=False: with it Triton contracts a product and the following add
into one FMA even across a `.to(bf16)` rounding in between, which is not what torch computes (rotary
then differs in about one element in five by an ulp). The kernels are memory-bound; FMA saves nothing.

Outputs are new tensors (the KV cache aside, which `rotary_write_kv` writes); inputs are never written, so callers need not care who else holds them.
Nothing syncs with the host and the only allocations are the outputs (sized from host shapes), so
the kernels can be captured in a CUDA graph. Per-call sizes (token counts) are not specialized on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# RMSNorm, optionally with the residual add
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, h_ptr, hidden, eps,
                     stride_x, stride_r, stride_out, stride_h,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token row; the whole row is one block."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual: [tokens, hidden] (rows may be strided, the last dim contiguous); weight: [hidden].

    Without a residual returns norm(x); with one returns (norm(x + residual), x + residual), both new
    tensors in x's dtype (vLLM's fused_add_rms_norm, minus its in-place writes).
    """
    tokens, hidden = x.shape
    x = _last_dim_contiguous(x)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    h = None
    if residual is not None:
        residual = _last_dim_contiguous(residual)
        h = torch.empty_like(out)
    if tokens:
        block = triton.next_power_of_2(hidden)
        source = residual if residual is not None else x
        target = h if h is not None else out
        _rms_norm_kernel[(tokens,)](
            x, source, weight, out, target, hidden, eps,
            x.stride(0), source.stride(0), out.stride(0), target.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block), enable_fp_fusion=False)
    return out if residual is None else (out, h)


# ----------------------------------------------------------------------------------------------
# SiLU and mul
# ----------------------------------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, intermediate, stride_x, stride_out, BLOCK: tl.constexpr):
    """Program (token, column block): BLOCK columns of gate and the same columns of up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < intermediate
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * I], gate columns then up columns (gate_up_proj's output) -> [tokens, I]."""
    tokens, width = x.shape
    intermediate = width // 2
    x = _last_dim_contiguous(x)
    out = torch.empty((tokens, intermediate), dtype=x.dtype, device=x.device)
    if tokens:
        block = min(triton.next_power_of_2(intermediate), 1024)
        grid = (tokens, triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](x, out, intermediate, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
                                   enable_fp_fusion=False)
    return out


# ----------------------------------------------------------------------------------------------
# Rotary embedding (Hugging Face's half-split layout)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rotate(src_ptr, dst_ptr, row, stride_src_t, stride_src_h, stride_dst_t, stride_dst_h, num_heads,
            c1, c2, s1, s2, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """All heads of one token: [heads, head_dim] -> x * cos + rotate_half(x) * sin, rounded as torch does."""
    heads = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    src = src_ptr + row * stride_src_t + heads[:, None] * stride_src_h + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = dst_ptr.dtype.element_ty
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)
    out2 = (f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)
    dst = dst_ptr + row * stride_dst_t + heads[:, None] * stride_dst_h + offs[None, :]
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, position, stride_table, like_ptr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """A position's cos and sin, first and second half each, as [1, HALF_PAD] rows. cos/sin are fp32
    tables; torch rounds them to the activations' dtype (like_ptr's) before multiplying, and so does this."""
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    table = position * stride_table + offs
    dtype = like_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                   num_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_table,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                   K_HEADS_PAD: tl.constexpr):
    """One program per token: its cos/sin row is read once for all q and k heads."""
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, position, stride_table, q_out_ptr, HALF, HALF_PAD)
    _rotate(q_ptr, q_out_ptr, row, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads,
            c1, c2, s1, s2, HALF, Q_HEADS_PAD, HALF_PAD)
    _rotate(k_ptr, k_out_ptr, row, stride_kt, stride_kh, stride_kot, stride_koh, num_kv_heads,
            c1, c2, s1, s2, HALF, K_HEADS_PAD, HALF_PAD)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [tokens]; q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], any token and
    head strides (views into the qkv projection's output are read in place); cos, sin: [max_position,
    head_dim] fp32. Returns new contiguous rotated q and k."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            positions, q, k, q_out, k_out, cos, sin, num_heads, num_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), Q_HEADS_PAD=triton.next_power_of_2(num_heads),
            K_HEADS_PAD=triton.next_power_of_2(num_kv_heads), num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


# ----------------------------------------------------------------------------------------------
# Rotary embedding and the KV-cache write, one launch
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rotary_write_kv_kernel(positions_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            cos_ptr, sin_ptr, num_heads, num_kv_heads,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
                            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_table,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                            K_HEADS_PAD: tl.constexpr):
    """One program per token: rotated q to q_out, rotated k and v to the token's cache slot."""
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, position, stride_table, q_out_ptr, HALF, HALF_PAD)
    _rotate(q_ptr, q_out_ptr, row, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads,
            c1, c2, s1, s2, HALF, Q_HEADS_PAD, HALF_PAD)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _rotate(k_ptr, k_cache_ptr + block * stride_kcb + offset * stride_kcs, row, stride_kt, stride_kh, 0, stride_kch,
            num_kv_heads, c1, c2, s1, s2, HALF, K_HEADS_PAD, HALF_PAD)
    heads = tl.arange(0, K_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    v_mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=v_mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :],
             v, mask=v_mask)


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """positions, slot_mapping: [tokens]; q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
    (any token and head strides: views into the qkv projection's output are read in place); cos, sin:
    [max_position, head_dim] fp32; caches: [num_blocks + 1, block_size, kv_heads, head_dim], each slot's
    [kv_heads, head_dim] contiguous. Writes rotated k and v at the slots; returns the rotated q (new,
    contiguous)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens:
        half = head_dim // 2
        _rotary_write_kv_kernel[(tokens,)](
            positions, q, k, v, q_out, k_cache, v_cache, slot_mapping, cos, sin, num_heads, num_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.stride(0),
            BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), Q_HEADS_PAD=triton.next_power_of_2(num_heads),
            K_HEADS_PAD=triton.next_power_of_2(num_kv_heads), num_warps=4, enable_fp_fusion=False)
    return q_out


# ----------------------------------------------------------------------------------------------
# Greedy sampling: argmax with min_tokens' stop-token ban
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_stops"])
def _greedy_sample_kernel(logits_ptr, stop_ptr, min_tokens_ptr, num_generated_ptr, out_ptr, vocab, num_stops,
                          stride_l, stride_s, STOPS_PAD: tl.constexpr, HAS_STOPS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row, BLOCK logits at a time; the first index of the largest value wins (torch's argmax)."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_STOPS:
        offs_s = tl.arange(0, STOPS_PAD)
        stops = tl.load(stop_ptr + row * stride_s + offs_s, mask=offs_s < num_stops, other=-1)
        banned = tl.load(num_generated_ptr + row) < tl.load(min_tokens_ptr + row)
        stops = tl.where(banned, stops, -1)  # -1 matches no token
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        values = tl.load(logits_ptr + row * stride_l + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        if HAS_STOPS:
            hit = tl.sum((offs[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
            values = tl.where(hit, float("-inf"), values)
        block_max = tl.max(values, axis=0)
        block_index = tl.argmax(values, axis=0).to(tl.int32) + start
        best_index = tl.where(block_max > best, block_index, best_index)  # ties keep the earlier block
        best = tl.maximum(best, block_max)
    tl.store(out_ptr + row, best_index.to(tl.int64))


def greedy_sample(logits: torch.Tensor, stop_ids: torch.Tensor, min_tokens: torch.Tensor,
                  num_generated: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] (any float dtype, last dim contiguous); stop_ids: [rows, S] int64, -1 padded;
    min_tokens, num_generated: [rows]. Returns [rows] int64: each row's argmax, its stop ids excluded while
    num_generated < min_tokens (the sampler's greedy path, which adds -inf at those ids)."""
    rows, vocab = logits.shape
    logits = _last_dim_contiguous(logits)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        num_stops = stop_ids.shape[1]
        _greedy_sample_kernel[(rows,)](
            logits, stop_ids, min_tokens, num_generated, out, vocab, num_stops, logits.stride(0),
            stop_ids.stride(0), STOPS_PAD=max(triton.next_power_of_2(num_stops), 2), HAS_STOPS=num_stops > 0,
            BLOCK=min(triton.next_power_of_2(vocab), 4096), num_warps=8)
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # the kernels index the last dim with unit stride; the model's views (qkv splits, gate_up) have it
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_warps(block: int) -> int:
    return max(1, min(block // 512, 16))
