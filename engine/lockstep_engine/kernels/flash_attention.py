"""Paged attention through FlashAttention-4 (`flash-attn-4` on PyPI: CuTe DSL kernels, compiled on first
use of each shape), behind the same interface as `TorchPagedAttention`.

An optional extra (`pip install 'lockstep[flash-attn]'`); without it, asking for this backend is an
error that names the extra, and `auto` never picks it.

Both phases call `flash_attn_varlen_func` on the paged cache itself ([num_blocks + 1, block_size,
kv_heads, head_dim] is FlashAttention's paged layout), with the engine's block table as `page_table`
and the context lengths as `seqused_k`:
* decode: q as [seqs, 1, heads, head_dim];
* prefill and mixed steps: q varlen through `cu_seqlens_q` (the step's `query_start_loc`).
Causal masking is bottom-right aligned, so query j of a chunk of q_len tokens sees the keys up to
seq_len - q_len + j: a chunk after cached context, and a decode row, are both plain causal.
FlashAttention takes int32 lengths and tables; the engine's are int64, so they are converted once per
step (`AttentionMetadata.int32`) and every layer reuses the copies.
Pages past a row's length are read but masked; they must hold finite values, which the
zero-initialised cache and its writes keep true.
Decode launches no host sync and sizes nothing from device values (lengths and the table stay on the
device; the bound on a row's length is the table's width), so the decode graphs capture it like the
Triton backend. The first call of each kernel variant compiles it (seconds): the server's warm-up runs
the shapes it serves before it reports ready.
"""

from __future__ import annotations

import torch

from lockstep_engine.attention import AttentionMetadata, PagedAttention, TorchPagedAttention

EXTRA = "flash-attn"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def load_flash_attn():
    """flash_attn.cute.flash_attn_varlen_func, or an ImportError that names the extra to install."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as error:
        raise ImportError(f"attention_backend='flash-attn' needs the flash-attn-4 package: "
                          f"pip install 'lockstep[{EXTRA}]' ({error})") from error
    return flash_attn_varlen_func


class FlashAttnPagedAttention(PagedAttention):
    """FlashAttention-4 over the paged cache; drop-in for TorchPagedAttention on CUDA (bf16 / fp16)."""

    name = "flash-attn"
    graph_safe = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_splits: int = 1, pack_gqa: bool | None = None):
        """num_splits: FlashAttention's split-KV count for decode (0: its own heuristic); pack_gqa: put a
        KV head's query heads in one tile (None: its heuristic)."""
        if not (8 <= head_dim <= 256 and head_dim % 8 == 0):
            raise ValueError(f"flash-attn attention supports head_dim a multiple of 8 in [8, 256], got {head_dim}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self._attention = load_flash_attn()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5
        self.num_splits, self.pack_gqa = num_splits, pack_gqa

    write_kv = staticmethod(TorchPagedAttention.write_kv)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q: [tokens, heads, head_dim] over the cache, this step's k and v already written."""
        if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype:
            raise TypeError(f"flash-attn attention: q {q.dtype} and cache {k_cache.dtype} must be one of "
                            f"{SUPPORTED_DTYPES}")
        if q.shape[0] == 0:
            return torch.empty_like(q)
        seq_lens, table = meta.int32("seq_lens"), meta.int32("block_tables")
        common = dict(seqused_k=seq_lens, page_table=table, softmax_scale=self.scale, causal=True,
                      pack_gqa=self.pack_gqa)
        if meta.is_decode:
            out, _ = self._attention(q.unsqueeze(1), k_cache, v_cache, num_splits=self.num_splits, **common)
            return out.squeeze(1)
        starts = meta.query_start_loc_host
        max_q = max(end - start for start, end in zip(starts, starts[1:]))
        out, _ = self._attention(q, k_cache, v_cache, cu_seqlens_q=meta.int32("query_start_loc"),
                                 max_seqlen_q=max_q, **common)
        return out
