"""Process groups for tensor and pipeline parallelism. With one rank every collective is a no-op."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None  # torch.distributed ProcessGroup when tp_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


SINGLE = ParallelState()


def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=-1)
