"""Paged attention in Triton: the GPU backend behind the same interface as `TorchPagedAttention`.

Three kernels, all over the paged KV cache [num_blocks + 1, block_size, num_kv_heads, head_dim]:

* `_write_kv_kernel`: one launch writes this step's k and v rows at `slot_mapping` (unconditional:
  rows that write nothing already point at the sink block).
* `_decode_kernel` (+ `_decode_reduce_kernel`): one query token per row. A program owns one
  (row, kv head, split) and all `num_heads // num_kv_heads` query heads of that kv head (GQA packing),
  so each KV tile is read once per row. With few rows the context is split across programs
  (flash-decoding); the split count comes from a host heuristic on the batch size and
  `meta.max_seq_len`, and each program finds its own chunk from the row's *device* seq_len, so the
  result is right for any seq_len whatever split count a CUDA graph was captured with.
* `_prefill_kernel`: varlen queries (prefill chunks, mixed with decode rows). A program owns
  BLOCK_Q query tokens x the query heads of one kv head, finds its sequence by binary search over
  `query_start_loc` on the device, and runs a flash-attention loop with online softmax over the
  sequence's cached context through its block table, causal on the tiles near the diagonal.

Nothing here syncs with the host or sizes an allocation from device values: decode is graph-capturable.
Per-step integers (token and sequence counts, length bounds, split counts) are not specialized on, so
a new batch shape does not compile a new kernel variant mid-serving.
Scale head_dim ** -0.5, fp32 accumulation, output in q's dtype (bf16, fp16 or fp32; fp32 dots use
IEEE precision, not TF32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lockstep_engine.attention import AttentionMetadata, PagedAttention

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bf16 dot operands as raw
# uint16 bits; there the dots run on fp32 copies of the same values instead.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr, TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """TOKENS tokens per program; a token's [num_kv_heads, head_dim] row is contiguous in k/v and in the cache."""
    offs_t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_e = tl.arange(0, ROW_PAD)
    mask = t_mask[:, None] & (offs_e < ROW)[None, :]
    token = offs_t.to(tl.int64)
    k = tl.load(k_ptr + token[:, None] * stride_kt + offs_e[None, :], mask=mask)
    v = tl.load(v_ptr + token[:, None] * stride_vt + offs_e[None, :], mask=mask)
    tl.store(k_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None] + offs_e[None, :], k, mask=mask)
    tl.store(v_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None] + offs_e[None, :], v, mask=mask)


# ----------------------------------------------------------------------------------------------
# One KV tile of the online-softmax loop (shared by decode and prefill)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, kv_head, table_ptr, k_cache_ptr, v_cache_ptr,
                 stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, qk_scale,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MASK_KV: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [M, D] fp32, m_i / l_i [M] fp32 (m_i in log2 units), q [M, D]; keys n0 .. n0 + BLOCK_N."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n < kv_end
    if MASK_KV:
        page = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    else:
        page = tl.load(table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    row = offs_n % BLOCK_SIZE
    k_off = page[:, None] * stride_kcb + row[:, None] * stride_kcs + kv_head * stride_kch + offs_d[None, :]
    v_off = page[:, None] * stride_vcb + row[:, None] * stride_vcs + kv_head * stride_vch + offs_d[None, :]
    if MASK_KV:
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_off)
    if _INTERPRET:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = s * qk_scale  # [M, BLOCK_N], log2 units
    if MASK_KV:
        s = tl.where(kv_mask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows with every key masked so far keep m = -inf; subtract 0 instead so nothing turns NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK_KV:
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_off)
    if _INTERPRET:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["max_len", "num_splits"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr, out_ptr,
                   part_acc_ptr, part_ml_ptr,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                   qk_scale, max_len, num_splits,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq).to(tl.int32), max_len)
    # this split's chunk: a whole number of tiles, from the row's own length
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    full_end = tl.maximum(start + (end - start) // BLOCK_N * BLOCK_N, start)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    table = table_ptr + seq * stride_bt

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, offs_g, n0, end, kv_head, table, k_cache_ptr, v_cache_ptr,
                                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                                     qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    if full_end < end:
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, offs_g, full_end, end, kv_head, table, k_cache_ptr,
                                     v_cache_ptr, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                                     stride_vch, qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, False, DOT_PRECISION)

    if SPLIT:
        # partials [seqs, heads, splits, (D | m, l)]; an empty chunk writes m = -inf, l = 0, acc = 0
        part = (seq * NUM_HEADS + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    base = (seq * NUM_HEADS + head) * num_splits
    m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None],
                  other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Prefill / mixed (varlen)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles hold global tile `tile`: the last i with start_i // BLOCK_Q + i <= tile."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(query_start_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if val <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "max_len"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                    qk_scale, num_seqs, max_len,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq).to(tl.int32), max_len)
    context = seq_len - q_len  # cached tokens before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = local * BLOCK_Q + offs_m // GROUP  # query token within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)
    q_pos = context + q_idx
    table = table_ptr + seq.to(tl.int64) * stride_bt

    # keys below the tile's first query position are visible to every row: no mask
    first_pos = context + local * BLOCK_Q
    kv_end = tl.minimum(seq_len, context + tl.minimum((local + 1) * BLOCK_Q, q_len))
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, kv_head, table, k_cache_ptr, v_cache_ptr,
                                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                                     qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, False, DOT_PRECISION)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n0, kv_end, kv_head, table, k_cache_ptr, v_cache_ptr,
                                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                                     qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, True, DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter runs: any small number keeps the heuristic exercised
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


class TritonPagedAttention(PagedAttention):
    """Paged decode (split-KV when rows are few) and varlen prefill kernels; drop-in for TorchPagedAttention."""

    name = "triton"
    graph_safe = True  # decode launches no host syncs and sizes nothing from device values
    # prefill too: its grid is an upper bound from the token and sequence counts, its sequences come from the
    # device (runner/prefill_graphs.py pads both)
    prefill_graph_safe = True

    # decode: the shortest chunk worth a split of its own, and the most splits
    MIN_SPLIT_TOKENS = 64
    MAX_SPLITS = 64

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 decode_splits: int | None = None):
        """decode_splits: fix the split-KV count of decode (None: a heuristic on batch size and max_seq_len)."""
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"triton attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got head_dim={head_dim}; "
                             "use attention_backend='torch'")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.fixed_decode_splits = decode_splits
        self.scale = head_dim ** -0.5
        self.group = num_heads // num_kv_heads
        self.group_pad = max(16, triton.next_power_of_2(self.group))  # tl.dot needs M >= 16

    def tiles(self, dtype: torch.dtype) -> dict:
        """Tile shapes per dtype. bf16/fp16 dots run on tensor cores; fp32 (IEEE, no TF32) runs on FMA
        units and holds twice the bytes per tile, so its tiles are halved to keep registers from spilling.
        The 16-bit decode tiles are the fastest of benchmarks/attention_backends.py --decode-sweep (block_n
        x warps x stages, 64-256 rows at 330 tokens, on an H100): head_dim 128 (Llama-3-8B) 32 keys, 4
        warps, 2 stages, 2-5% under the 64 / 4 / 3 before; head_dim 64 (SmolLM2-135M) 64 keys, 2 warps,
        2 stages, 8-19% under it."""
        wide = dtype != torch.float32
        block_n = 64 if wide else 32
        block_m = max(64 if wide else 32, triton.next_power_of_2(self.group))  # rows: tokens x grouped heads
        if not wide:
            decode = dict(decode_block_n=32, decode_warps=8, decode_stages=3)
        elif self.head_dim >= 128:
            decode = dict(decode_block_n=32, decode_warps=4, decode_stages=2)
        else:
            decode = dict(decode_block_n=64, decode_warps=2, decode_stages=2)
        return dict(**decode,
                    prefill_block_n=block_n, prefill_block_m=block_m, prefill_block_q=block_m // self.group,
                    prefill_warps=8 if (not wide or (self.head_dim >= 128 and block_m >= 128)) else 4)

    # ---- KV write ----
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        tokens = k.shape[0]
        if tokens == 0:
            return
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        row = self.num_kv_heads * self.head_dim
        row_pad = triton.next_power_of_2(row)
        per_program = max(1, min(16, 4096 // row_pad))
        _write_kv_kernel[(triton.cdiv(tokens, per_program),)](
            k, v, k_cache, v_cache, slot_mapping, tokens, k.stride(0), v.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            ROW=row, ROW_PAD=row_pad, TOKENS=per_program, BLOCK_SIZE=self.block_size, num_warps=4)

    # ---- attention ----

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q over the cache, this step's k and v already written."""
        self._check(q, k_cache, v_cache)
        q = _last_dim_contiguous(q)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        if meta.is_decode:
            self._decode(q, k_cache, v_cache, meta, out)
        else:
            self._prefill(q, k_cache, v_cache, meta, out)
        return out

    def decode_splits(self, num_seqs: int, max_seq_len: int, device: torch.device, element_size: int = 2) -> int:
        """How many programs share one row's context. None while the (row, kv head) programs alone
        fill `waves` rounds of the multiprocessors; below that, enough programs for `waves` rounds, no
        chunk shorter than MIN_SPLIT_TOKENS. A program whose tokens are light (its K and V rows under
        512 bytes a token) needs more programs to keep the memory system busy: two waves at 512 bytes
        and more (head_dim 128 in 16 bits), four at 256 (head_dim 64). Fitted to
        benchmarks/attention_backends.py --split-sweep on an H100 (330 tokens a row): Llama-3-8B is
        fastest with 2 splits at 32 rows (256 programs) and unsplit from 48 rows, SmolLM2-135M with
        6 / 3 / 2 splits at 32 / 64 / 128 rows. Any count is correct for any seq_len (chunks come from
        the device lengths), so a graph captured with one count replays right at other lengths."""
        programs = num_seqs * self.num_kv_heads
        sms = _sm_count(device)
        token_bytes = 2 * self.head_dim * element_size
        waves = 2 * max(1, 512 // token_bytes)
        if programs >= waves * sms:
            return 1
        want = triton.cdiv(waves * sms, programs)
        by_length = triton.cdiv(max(max_seq_len, 1), self.MIN_SPLIT_TOKENS)
        return max(1, min(want, by_length, self.MAX_SPLITS))

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor,
                num_splits: int | None = None) -> None:
        seqs = q.shape[0]
        table = meta.block_tables
        capacity = table.shape[1] * self.block_size
        max_len = min(meta.max_seq_len, capacity) if meta.max_seq_len > 0 else capacity
        if num_splits is None:
            num_splits = self.fixed_decode_splits
        if num_splits is None:
            num_splits = self.decode_splits(seqs, max_len, q.device, q.element_size())
        split = num_splits > 1
        if split:
            part_acc = torch.empty((seqs, self.num_heads, num_splits, self.head_dim), dtype=torch.float32,
                                   device=q.device)
            part_ml = torch.empty((seqs, self.num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = out  # unused
        cfg = self.tiles(q.dtype)
        _decode_kernel[(seqs, self.num_kv_heads, num_splits)](
            q, k_cache, v_cache, table, meta.seq_lens, out, part_acc, part_ml,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            self.scale * LOG2E, max_len, num_splits,
            NUM_HEADS=self.num_heads, GROUP=self.group, GROUP_PAD=self.group_pad, HEAD_DIM=self.head_dim,
            BLOCK_SIZE=self.block_size, BLOCK_N=cfg["decode_block_n"], SPLIT=split,
            DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg["decode_warps"], num_stages=cfg["decode_stages"])
        if split:
            _decode_reduce_kernel[(seqs, self.num_heads)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), num_splits,
                NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim,
                SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=1 if self.head_dim <= 64 else 2)

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        tokens = q.shape[0]
        num_seqs = meta.seq_lens.shape[0]
        table = meta.block_tables
        capacity = table.shape[1] * self.block_size
        cfg = self.tiles(q.dtype)
        block_q = cfg["prefill_block_q"]
        tiles = tokens // block_q + num_seqs  # upper bound on sum over sequences of cdiv(q_len, block_q)
        _prefill_kernel[(tiles, self.num_kv_heads)](
            q, k_cache, v_cache, table, meta.seq_lens, meta.query_start_loc, out,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            self.scale * LOG2E, num_seqs, capacity,
            GROUP=self.group, BLOCK_M=cfg["prefill_block_m"], BLOCK_Q=block_q, HEAD_DIM=self.head_dim,
            BLOCK_SIZE=self.block_size, BLOCK_N=cfg["prefill_block_n"], DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=cfg["prefill_warps"], num_stages=2)

    def _check(self, q, k_cache, v_cache) -> None:
        if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"triton attention: unsupported dtype {q.dtype}")
        if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise TypeError(f"triton attention: cache dtype {k_cache.dtype} differs from q dtype {q.dtype}")
        for cache in (k_cache, v_cache):
            if cache.stride(-1) != 1 or cache.stride(-2) != self.head_dim:
                raise ValueError("triton attention: each cache slot's [num_kv_heads, head_dim] must be contiguous")
        if q.shape[-1] != self.head_dim or k_cache.shape[1] != self.block_size:
            raise ValueError(f"triton attention: built for head_dim={self.head_dim}, block_size={self.block_size}; "
                             f"got q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] with each token's heads x head_dim packed (token stride free)."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
