"""Engine groups of several ranks: rendezvous, the leader's window broadcast, the worker loop.

Rank 0 (the leader) schedules; before each window it broadcasts the window plan, and every rank
runs the same window on its shard. The plan travels as a delta (`plan_codec`): a request's prompt and
sampling parameters once, then per window only the tokens and blocks each row gained and the row's
step-1 work, so a message stays a few bytes per row however long the contexts grow. Sampling needs no broadcast: logits are gathered on every rank
and the sampler's randomness is a function of (seed, position, token), so all ranks draw the same
tokens and write the same KV slots. Collectives carry a timeout so a lost rank becomes an error.

Environment (DESIGN.md §5.4): LOCKSTEP_RANK, LOCKSTEP_WORLD_SIZE, LOCKSTEP_LEADER_ADDR,
LOCKSTEP_RENDEZVOUS_PORT (default 29500), LOCKSTEP_GROUP.
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

from lockstep_engine import guided
from lockstep_engine.config import EngineConfig
from lockstep_engine.parallel import ParallelState
from lockstep_engine.plan_codec import PlanDecoder, PlanEncoder
from lockstep_engine.sources import log

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
    atexit.register(_stop_workers, workers)
    return workers


def _stop_workers(workers: list[subprocess.Popen]) -> None:
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


class LeaderRunner:
    """The leader's runner: mirrors every window to the workers, then runs it locally."""

    def __init__(self, runner, workers: list[subprocess.Popen]):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_workers", workers)
        object.__setattr__(self, "_encoder", PlanEncoder())

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __setattr__(self, name, value):
        setattr(self._runner, name, value)

    def check_workers(self) -> None:
        dead = [w.pid for w in self._workers if w.poll() is not None]
        if dead:
            raise GroupError(f"engine group worker process(es) {dead} exited")

    def execute_window(self, plan, on_step, continuing: bool = False):
        self.check_workers()
        try:
            dist.broadcast_object_list([("window", self._encoder.encode(plan))], src=0)
        except RuntimeError as error:
            raise GroupError(f"broadcasting the window plan to the engine group failed: {error}") from error
        return self._runner.execute_window(plan, on_step, continuing)

    def shutdown(self) -> None:
        try:
            dist.broadcast_object_list([("stop", None)], src=0)
        except RuntimeError:
            pass
        _stop_workers(self._workers)


def create_runner(config: EngineConfig, source):
    """A ModelRunner for a single rank, or the leader of a group (spawning local workers when the
    environment does not name a rank, as `lockstep serve --tensor-parallel-size T` does)."""
    from lockstep_engine.model_runner import ModelRunner, resolve_device

    world = world_size(config)
    if world == 1:
        return ModelRunner(config, source)
    _check_layout(config, source.config)
    device = resolve_device(config.device).type
    workers = []
    if "LOCKSTEP_RANK" in os.environ:
        rank = int(os.environ["LOCKSTEP_RANK"])
        if rank != 0:
            raise GroupError(f"LOCKSTEP_RANK={rank}: only rank 0 serves; other ranks run `lockstep worker`")
        leader = os.environ.get("LOCKSTEP_LEADER_ADDR", "127.0.0.1")
        port = int(os.environ.get("LOCKSTEP_RENDEZVOUS_PORT", DEFAULT_PORT))
    else:
        leader, port = "127.0.0.1", free_port()
        workers = spawn_local_workers(config, port)
    state = init_group(0, world, leader, port, device, config.tensor_parallel_size)
    return LeaderRunner(ModelRunner(config, source, state), workers)


def _check_layout(config: EngineConfig, model) -> None:
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


def run_worker(config: EngineConfig) -> int:
    """A non-leader rank: load the shard, then run every window the leader broadcasts."""
    from lockstep_engine.model_runner import ModelRunner, resolve_device
    from lockstep_engine.sources import resolve

    rank = int(os.environ["LOCKSTEP_RANK"])
    world = int(os.environ.get("LOCKSTEP_WORLD_SIZE", world_size(config)))
    if world != world_size(config):
        raise GroupError(f"LOCKSTEP_WORLD_SIZE={world} does not match tensor_parallel_size x "
                         f"pipeline_parallel_size = {world_size(config)}")
    source = resolve(config.model, seed=config.seed)
    config = config.with_model_limits(source.config.max_position_embeddings)
    _check_layout(config, source.config)
    state = init_group(rank, world, os.environ.get("LOCKSTEP_LEADER_ADDR", "127.0.0.1"),
                       int(os.environ.get("LOCKSTEP_RENDEZVOUS_PORT", DEFAULT_PORT)),
                       resolve_device(config.device).type, config.tensor_parallel_size)
    runner = ModelRunner(config, source, state)
    tokenizer = source.load_tokenizer() if source.load_tokenizer is not None else None
    guided.install(runner, tokenizer)  # the last stage samples: it needs the grammar masks too
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
        if plan is not None:
            runner.execute_window(plan, lambda step: None)
