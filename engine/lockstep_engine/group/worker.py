"""The worker loop: a non-leader rank of an engine group runs every window the leader broadcasts."""

from __future__ import annotations

import os

import torch.distributed as dist

from lockstep_engine.config import EngineConfig
from lockstep_engine.group.executor import load_engine
from lockstep_engine.group.plan_codec import PlanDecoder
from lockstep_engine.group.rendezvous import GroupError, world_size
from lockstep_engine.log import log


def run_worker(config: EngineConfig) -> int:
    """Loads this rank's shard (rank from LOCKSTEP_RANK), then runs the leader's windows until it
    says stop (0) or is lost (1)."""
    rank = int(os.environ["LOCKSTEP_RANK"])
    world = int(os.environ.get("LOCKSTEP_WORLD_SIZE", world_size(config)))
    if world != world_size(config):
        raise GroupError(f"LOCKSTEP_WORLD_SIZE={world} does not match tensor_parallel_size x "
                         f"pipeline_parallel_size = {world_size(config)}")
    if rank == 0:
        raise GroupError("LOCKSTEP_RANK=0 is the leader: it runs `lockstep serve`, not `lockstep worker`")
    executor = load_engine(config, rank).executor
    decoder = PlanDecoder()
    log(f"rank {rank}: ready")
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0)
        except RuntimeError as error:
            log(f"rank {rank}: lost the leader ({error}); exiting")
            return 1
        kind, data = message[0]
        if kind == "stop":
            return 0
        plan = decoder.decode(data)
        if plan is not None:  # None: a release-only message, nothing to run
            executor.execute_window(plan, lambda step: None)
