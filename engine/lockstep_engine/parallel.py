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
    world_group: object = None  # every rank of the engine group (window plans, sampled tokens)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp_size  # same TP rank, previous stage

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def sampler_rank(self) -> int:
        """The rank whose samples every rank adopts: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

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


def pp_send(hidden: torch.Tensor, state: ParallelState) -> None:
    dist.send(hidden.contiguous(), dst=state.next_rank, group=state.world_group)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, state: ParallelState) -> torch.Tensor:
    hidden = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(hidden, src=state.prev_rank, group=state.world_group)
    return hidden


def broadcast_from_sampler(tensors: list[torch.Tensor], state: ParallelState) -> None:
    for tensor in tensors:
        dist.broadcast(tensor, src=state.sampler_rank, group=state.world_group)


def pp_isend(hidden: torch.Tensor, state: ParallelState) -> tuple[object, torch.Tensor]:
    """Starts sending to the next stage; returns (work, tensor): keep both until `work.wait()`."""
    hidden = hidden.contiguous()
    return dist.isend(hidden, dst=state.next_rank, group=state.world_group), hidden
