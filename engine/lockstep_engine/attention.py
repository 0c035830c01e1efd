"""Paged attention. The torch backend is the reference every other kernel is tested against.

Every backend has `write_kv` (this step's k and v to their slots), `attend` (q over the cache, the
step's k and v already written: the model writes them together with rotary) and `__call__` (both).

KV cache per layer: [num_blocks + 1, block_size, num_kv_heads, head_dim]; the extra last block is a
sink for slot -1 (rows that finished mid-window), so writes never branch and shapes stay static.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64, sink slot for rows that write nothing
    block_tables: torch.Tensor  # [seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor  # [seqs] context length including this step's tokens
    query_start_loc: torch.Tensor | None  # [seqs + 1]; None: decode, one token per sequence
    query_start_loc_host: list[int] | None = None  # the same on the host (prefill loop)
    seq_lens_host: list[int] | None = None
    max_seq_len: int = 0  # host bound used for gathering (decode)
    lora_slots: torch.Tensor | None = None  # [tokens] LoRA weight slot per token; None: no adapter in the batch

    # int32 copies of the tensors above, made by the first layer that asks and reused by the others
    _int32: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_decode(self) -> bool:
        return self.query_start_loc is None

    def int32(self, name: str) -> torch.Tensor:
        """`name`'s tensor as int32 (kernels that take no int64 lengths or tables), converted once per step."""
        if name not in self._int32:
            self._int32[name] = getattr(self, name).to(torch.int32)
        return self._int32[name]


class PagedAttention:
    """What every backend's call is: write this step's k and v into the cache at their slots, then attend
    q over the cache. Backends give `write_kv` and `attend` (the model may also call them apart: the fused
    rotary kernel writes k and v itself)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta)


class TorchPagedAttention(PagedAttention):
    """SDPA over KV gathered from the block table; correct for any mix of prefill and decode."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.scale = head_dim ** -0.5

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache, this step's k and v already in it (the model writes them with rotary)."""
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache, meta)
        return self._prefill(q, k_cache, v_cache, meta)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` cached tokens of one sequence ([length, H, D]) or of each row ([B, length, H, D])."""
        num_blocks = -(-length // self.block_size)
        if block_table.dim() == 1:
            return cache[block_table[:num_blocks]].flatten(0, 1)[:length]
        return cache[block_table[:, :num_blocks]].flatten(1, 2)[:, :length]

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        length = meta.max_seq_len
        keys = self._gather(k_cache, meta.block_tables, length)  # [seqs, length, kv_heads, head_dim]
        values = self._gather(v_cache, meta.block_tables, length)
        mask = torch.arange(length, device=q.device) < meta.seq_lens.unsqueeze(1)  # [seqs, length]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [seqs, heads, 1, head_dim]
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(2)

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        starts, lens = meta.query_start_loc_host, meta.seq_lens_host
        out = torch.empty_like(q)
        for index, seq_len in enumerate(lens):
            start, end = starts[index], starts[index + 1]
            q_len = end - start
            if q_len == 0:  # a padding sequence (runner/prefill_graphs.py)
                continue
            table = meta.block_tables[index]
            keys = self._gather(k_cache, table, seq_len).transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            values = self._gather(v_cache, table, seq_len).transpose(0, 1)
            query = q[start:end].transpose(0, 1)  # [heads, q_len, head_dim]
            if q_len == 1:
                mask = None
            else:
                # query j sits at position seq_len - q_len + j and sees keys up to it
                rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows
            result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale,
                                                    enable_gqa=self.num_heads != self.num_kv_heads)
            out[start:end] = result.transpose(0, 1)
        return out

