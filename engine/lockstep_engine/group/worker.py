"""The worker loop: a non-leader rank of an engine group runs every window the leader broadcasts."""

from __future__ import annotations

import os

from lockstep_engine.config import EngineConfig
from lockstep_engine.group.channel import STOP
from lockstep_engine.group.errors import AuthenticationError
from lockstep_engine.group.executor import load_engine
from lockstep_engine.group.plan_codec import PlanCodecError, PlanDecoder
from lockstep_engine.group.rendezvous import GroupError, world_size
from lockstep_engine.log import log


def run_worker(config: EngineConfig) -> int:
    """Loads this rank's shard (rank from LOCKSTEP_RANK), then runs the leader's windows until it
    says stop (0), is lost (1) or sends what this rank refuses (1: a frame that fails authentication,
    a plan that fails to decode)."""
    rank = int(os.environ["LOCKSTEP_RANK"])
    world = int(os.environ.get("LOCKSTEP_WORLD_SIZE", world_size(config)))
    if world != world_size(config):
        raise GroupError(f"LOCKSTEP_WORLD_SIZE={world} does not match tensor_parallel_size x "
                         f"pipeline_parallel_size = {world_size(config)}")
    if rank == 0:
        raise GroupError("LOCKSTEP_RANK=0 is the leader: it runs `lockstep serve`, not `lockstep worker`")
    try:
        loaded = load_engine(config, rank)
    except (GroupError, ValueError) as error:  # the rendezvous, the model or the layout: the message names it
        log(f"error: rank {rank}: {error}; exiting")
        return 1
    executor, channel = loaded.executor, loaded.channel
    decoder = PlanDecoder()
    log(f"rank {rank}: ready")
    while True:
        try:
            kind, data = channel.receive()
            if kind == STOP:
                return 0
            plan = decoder.decode(data)
        except (AuthenticationError, PlanCodecError) as error:
            log(f"error: rank {rank}: {error}; exiting")
            return 1
        except RuntimeError as error:
            log(f"error: rank {rank}: lost the leader ({error}); exiting")
            return 1
        if plan is not None:  # None: a release-only message, nothing to run
            executor.execute_window(plan, lambda step: None)
