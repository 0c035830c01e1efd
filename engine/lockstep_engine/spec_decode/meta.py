"""Attention metadata for several query positions per row (the verify forward and the draft's first
forward), as decode metadata: each query token is its own decode sequence over its row's block table,
seeing keys up to its own position. Every backend's decode path then runs it unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep_engine.attention import AttentionMetadata


@dataclass
class QueryLayout:
    """The rows' KV layout for a window: what any forward over them needs besides the positions."""

    table: torch.Tensor  # [rows, max_blocks] block table, padded with the sink block
    block_size: int
    sink_slot: int
    max_model_len: int

    def meta(self, positions: torch.Tensor, done: torch.Tensor, max_seq_len: int,
             rows: torch.Tensor | None = None) -> AttentionMetadata:
        """positions: [rows, Q] of this forward's query tokens; done: [rows] rows that write nothing. With
        `rows`, positions is flat instead ([tokens]) and rows[i] is token i's row: rows may then have
        different numbers of query tokens. A position past the row's reservation (the table) or past
        max_model_len writes to the sink."""
        bs, width = self.block_size, self.table.shape[1]
        if rows is None:
            queries = positions.shape[1]
            rows = torch.arange(positions.shape[0], device=positions.device).repeat_interleave(queries)
        flat = positions.flatten()
        tables = self.table.index_select(0, rows)
        block = flat // bs
        slot = tables.gather(1, block.clamp(max=width - 1).unsqueeze(1)).squeeze(1) * bs + flat % bs
        sink = done.index_select(0, rows) | (block >= width) | (flat >= self.max_model_len)
        slot = torch.where(sink, self.sink_slot, slot)
        max_seq_len = min(max_seq_len, width * bs)
        return AttentionMetadata(slot_mapping=slot, block_tables=tables, seq_lens=(flat + 1).clamp(max=max_seq_len),
                                 query_start_loc=None, max_seq_len=max_seq_len)

    def clamp(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions the rotary table has (a sink-bound query past max_model_len reads the last one)."""
        return positions.clamp(max=self.max_model_len - 1)
