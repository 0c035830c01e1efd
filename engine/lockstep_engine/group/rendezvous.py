"""Rendezvous of an engine group: ranks join over TCP, the leader spawns local workers, layout checks.

Environment (docs/ARCHITECTURE.md): LOCKSTEP_RANK, LOCKSTEP_WORLD_SIZE, LOCKSTEP_LEADER_ADDR,
LOCKSTEP_RENDEZVOUS_PORT (default 29500). Collectives carry a timeout so a lost rank
becomes an error.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep_engine.config import EngineConfig
from lockstep_engine.log import log
from lockstep_engine.parallel import ParallelState

DEFAULT_PORT = 29500
COLLECTIVE_TIMEOUT_S = float(os.environ.get("LOCKSTEP_COLLECTIVE_TIMEOUT_S", "60"))
LEADER_DNS_TIMEOUT_S = float(os.environ.get("LOCKSTEP_LEADER_DNS_TIMEOUT_S", "600"))
# Workers wait for the leader's next window with no deadline (an idle leader sends nothing); a
# leader that dies closes its sockets, which ends the wait with an error.
CONTROL_TIMEOUT = timedelta(days=7)


class GroupError(RuntimeError):
    """A rank of the engine group failed or cannot be reached."""


def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def _wait_for_dns(host: str) -> None:
    deadline = time.monotonic() + LEADER_DNS_TIMEOUT_S
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise GroupError(f"LOCKSTEP_LEADER_ADDR={host!r} did not resolve within {LEADER_DNS_TIMEOUT_S:.0f}s")
            time.sleep(1.0)


def init_group(rank: int, world: int, leader: str, port: int, device: str, tp: int | None = None) -> ParallelState:
    if world < 1 or not 0 <= rank < world:
        raise GroupError(f"LOCKSTEP_RANK={rank} is invalid: expected 0 <= rank < LOCKSTEP_WORLD_SIZE={world}")
    if rank != 0:
        _wait_for_dns(leader)
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    log(f"rank {rank}/{world}: joining the group at {leader}:{port} ({backend})")
    dist.init_process_group(backend, init_method=f"tcp://{leader}:{port}", rank=rank, world_size=world,
                            timeout=CONTROL_TIMEOUT)
    tp = tp or world
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    world_group = dist.new_group(list(range(world)), timeout=timeout)
    # Every rank creates every stage's TP group, in the same order (a torch.distributed rule).
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout) for s in range(world // tp)]
    return ParallelState(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=world // tp,
                         tp_group=tp_groups[rank // tp], world_group=world_group)


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphaned workers


def spawn_local_workers(config: EngineConfig, port: int) -> list[subprocess.Popen]:
    """Starts ranks 1..W-1 on this host, as `lockstep worker` processes."""
    workers = []
    for rank in range(1, world_size(config)):
        env = dict(os.environ, LOCKSTEP_RANK=str(rank), LOCKSTEP_WORLD_SIZE=str(world_size(config)),
                   LOCKSTEP_LEADER_ADDR="127.0.0.1", LOCKSTEP_RENDEZVOUS_PORT=str(port),
                   LOCKSTEP_ENGINE_CONFIG=json.dumps(asdict(config)))
        workers.append(subprocess.Popen([sys.executable, "-m", "lockstep.cli", "worker"], env=env,
                                        preexec_fn=_die_with_parent))
    atexit.register(stop_workers, workers)
    return workers


def stop_workers(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    for worker in workers:
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_layout(config: EngineConfig, model) -> None:
    tp = config.tensor_parallel_size
    if model.num_attention_heads % tp:
        raise GroupError(f"tensor_parallel_size={tp} does not divide the model's {model.num_attention_heads} "
                         f"attention heads")
    kv = model.num_key_value_heads
    if kv % tp and tp % kv:
        raise GroupError(f"tensor_parallel_size={tp} neither divides nor is a multiple of the model's {kv} KV heads")
    if model.intermediate_size % tp:
        raise GroupError(f"tensor_parallel_size={tp} does not divide the MLP size {model.intermediate_size}")
    pp = config.pipeline_parallel_size
    if pp > model.num_hidden_layers:
        raise GroupError(f"pipeline_parallel_size={pp} exceeds the model's {model.num_hidden_layers} layers")
