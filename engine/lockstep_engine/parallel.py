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


# ---- pipeline layout --------------------------------------------------------------------------
def head_weight_in_layers(config) -> float:
    """The LM head's weight bytes in decoder layers (`config`: a `ModelConfig`): what the last stage
    reads per step on top of its layers (decode reads every weight once per step, so bytes are what a
    stage's step time follows)."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    layer = h * q * 2 + h * kv * 2 + 3 * h * config.intermediate_size
    return config.vocab_size * h / layer


def stage_layers(num_layers: int, pp_rank: int, pp_size: int, head_layers: float = 0.0,
                 partition: tuple[int, ...] | None = None) -> range:
    """Layers of one pipeline stage. The stages get equal weight to read per step: the last one also
    runs the LM head, worth `head_layers` layers, so it takes fewer decoder layers; the others split the
    rest evenly, earlier stages taking the remainder. `partition` (`EngineConfig.pipeline_layer_partition`,
    one count per stage, already checked against `pp_size`) sets the counts instead."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    if partition:
        if sum(partition) != num_layers:
            raise ValueError(f"pipeline_layer_partition={','.join(map(str, partition))!r} is invalid: expected "
                             f"layer counts summing to the model's {num_layers} layers")
        counts = list(partition)
    elif pp_size == 1:
        counts = [num_layers]
    else:
        share = (num_layers + head_layers) / pp_size
        last = min(max(round(share - head_layers), 1), num_layers - (pp_size - 1))
        base, extra = divmod(num_layers - last, pp_size - 1)
        counts = [base + (1 if s < extra else 0) for s in range(pp_size - 1)] + [last]
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])
