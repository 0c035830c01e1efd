"""Rendezvous of an engine group: ranks join over TCP, the leader spawns local workers, layout checks.

Environment (docs/ARCHITECTURE.md, docs/RELIABILITY.md): LOCKSTEP_RANK, LOCKSTEP_WORLD_SIZE,
LOCKSTEP_LEADER_ADDR, LOCKSTEP_RENDEZVOUS_PORT (default 29500), LOCKSTEP_LOCAL_RANK (the GPU of this
rank, when set), LOCKSTEP_GROUP_SECRET_FILE or LOCKSTEP_GROUP_SECRET (`channel.load_secret`),
LOCKSTEP_RENDEZVOUS_TIMEOUT_S (default 600). A group that does not form within the rendezvous
timeout is a GroupError naming the missing ranks (the process exits, its supervisor restarts the
group); collectives carry their own timeout so a rank lost later becomes an error too.

The leader runs the rendezvous store (torch.distributed's TCPStore: unauthenticated, so nothing is
decoded from it but fixed-size proofs). On it, before any process group exists, every rank proves
that it knows the group secret: the leader publishes a fresh nonce and its own proof, each worker
its proof, and the leader its verdict; a rank that fails is refused by name on both sides.
"""

from __future__ import annotations

import atexit
import hmac
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep_common.processes import stop_processes
from lockstep_common.sockets import die_with_parent
from lockstep_engine.config import ConfigError, EngineConfig
from lockstep_engine.group.channel import (SECRET_ENV, SECRET_FILE_ENV, GroupChannel, channel_key, hello_proof,
                                           verdict_proof)
from lockstep_engine.group.errors import AuthenticationError, GroupError
from lockstep_engine.log import log
from lockstep_engine.parallel import ParallelState

DEFAULT_PORT = 29500
COLLECTIVE_TIMEOUT_S = float(os.environ.get("LOCKSTEP_COLLECTIVE_TIMEOUT_S", "60"))
LEADER_DNS_TIMEOUT_S = float(os.environ.get("LOCKSTEP_LEADER_DNS_TIMEOUT_S", "600"))
RENDEZVOUS_TIMEOUT_ENV = "LOCKSTEP_RENDEZVOUS_TIMEOUT_S"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
# Workers wait for the leader's next control message with no deadline (an idle leader sends
# nothing); a leader that dies closes its sockets, which ends the wait with an error.
CONTROL_TIMEOUT = timedelta(days=7)
_KEY = "lockstep/"  # the rendezvous store's keys of the hello (torch.distributed's own keys differ)


def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


def _wait_for_dns(host: str) -> None:
    deadline = time.monotonic() + LEADER_DNS_TIMEOUT_S
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror as error:
            if time.monotonic() > deadline:
                raise GroupError(f"LOCKSTEP_LEADER_ADDR={host!r} did not resolve within "
                                 f"{LEADER_DNS_TIMEOUT_S:.0f}s") from error
            time.sleep(1.0)


def rendezvous_timeout_s() -> float:
    text = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_RENDEZVOUS_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not 0 < value < 10**9:
        raise GroupError(f"{RENDEZVOUS_TIMEOUT_ENV}={text!r} is invalid: expected seconds, a number > 0")
    return value


def _set_device(rank: int) -> None:
    count = torch.cuda.device_count()
    text = os.environ.get("LOCKSTEP_LOCAL_RANK")
    if text is None:
        torch.cuda.set_device(rank % count)
        return
    if not text.isdigit() or int(text) >= count:
        raise GroupError(f"LOCKSTEP_LOCAL_RANK={text!r} is invalid: expected a GPU index in [0, {count - 1}] "
                         f"(this process sees {count} GPUs)")
    torch.cuda.set_device(int(text))


def init_group(rank: int, world: int, leader: str, port: int, device: str, secret: bytes | None,
               tp: int | None = None, listener: socket.socket | None = None) -> tuple[ParallelState, GroupChannel]:
    """Joins the group (rank 0 hosts the rendezvous, on `listener` when given, else on every
    interface), proves the secret, and returns this rank's parallel state and the group's control channel."""
    if world < 1 or not 0 <= rank < world:
        raise GroupError(f"LOCKSTEP_RANK={rank} is invalid: expected 0 <= rank < LOCKSTEP_WORLD_SIZE={world}")
    if secret is None:
        raise GroupError(f"rank {rank}: an engine group needs a shared secret on every rank: set {SECRET_FILE_ENV} "
                         f"(a file, as the operator mounts it) or {SECRET_ENV} (`lockstep serve` without "
                         "LOCKSTEP_RANK makes one for the ranks it spawns)")
    timeout_s = rendezvous_timeout_s()
    if rank != 0:
        _wait_for_dns(leader)
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        _set_device(rank)
    where = f"{leader}:{port}"
    log(f"rank {rank}/{world}: joining the group at {where} ({backend}, rendezvous timeout {timeout_s:g}s)")
    timeout = timedelta(seconds=timeout_s)
    store = _open_store(rank, world, leader, port, timeout, listener)
    nonce = _hello(store, rank, world, secret, where, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    tp = tp or world
    collective = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    world_group = dist.new_group(list(range(world)), timeout=collective)
    # Every rank creates every stage's TP group, in the same order (a torch.distributed rule).
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=collective) for s in range(world // tp)]
    channel = GroupChannel(channel_key(secret, nonce), world, CONTROL_TIMEOUT)
    state = ParallelState(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=world // tp,
                          tp_group=tp_groups[rank // tp], world_group=world_group)
    return state, channel


def _open_store(rank: int, world: int, leader: str, port: int, timeout: timedelta,
                listener: socket.socket | None) -> dist.TCPStore:
    try:
        # The store takes the listener's descriptor over (it closes it).
        fd = listener.detach() if listener is not None else None
        return dist.TCPStore(leader, port, world_size=world, is_master=rank == 0, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    except RuntimeError as error:  # DistNetworkError, DistStoreError
        if rank == 0:
            raise GroupError(f"rank 0: cannot open the rendezvous on port {port}: {error}") from error
        raise GroupError(f"rank {rank}: the leader's rendezvous at {leader}:{port} did not answer within "
                         f"{timeout.total_seconds():g}s ({RENDEZVOUS_TIMEOUT_ENV}): {error}") from error


def _hello(store: dist.TCPStore, rank: int, world: int, secret: bytes, where: str, timeout_s: float) -> str:
    """Every rank proves the secret against the leader's fresh nonce; returns the nonce."""
    if rank == 0:
        return _leader_hello(store, world, secret, where, timeout_s)
    try:
        nonce = store.get(_KEY + "nonce").decode("ascii", "replace")
        if len(nonce) != 32 or not all(c in "0123456789abcdef" for c in nonce):
            raise GroupError(f"rank {rank}: the rendezvous at {where} holds no nonce of a leader; refused")
        # The leader's proof is read before this rank's hello is sent: a leader that refuses the hello
        # exits, and its store with it, so the proof could not be read after.
        leader_proof = store.get(_KEY + "hello/0")
        if store.add(f"{_KEY}joined/{rank}", 1) != 1:
            raise GroupError(f"rank {rank}: another process already joined the group at {where} as rank {rank}")
        store.set(f"{_KEY}hello/{rank}", hello_proof(secret, nonce, world, rank))
        if not hmac.compare_digest(leader_proof, hello_proof(secret, nonce, world, 0)):
            raise AuthenticationError(f"rank {rank}: the leader at {where} failed authentication (its group secret "
                                      "differs from this rank's); refused")
        verdict = store.get(_KEY + "verdict")
    except RuntimeError as error:
        if isinstance(error, GroupError):
            raise
        raise GroupError(f"rank {rank}: the group at {where} did not form within {timeout_s:g}s "
                         f"({RENDEZVOUS_TIMEOUT_ENV}), or its leader left: {error}") from error
    if not hmac.compare_digest(verdict, verdict_proof(secret, nonce, world)):
        raise AuthenticationError(f"rank {rank}: the leader at {where} refused the group (a rank failed "
                                  "authentication; see the leader's log)")
    return nonce


def _leader_hello(store: dist.TCPStore, world: int, secret: bytes, where: str, timeout_s: float) -> str:
    nonce = secrets.token_hex(16)
    store.set(_KEY + "hello/0", hello_proof(secret, nonce, world, 0))
    store.set(_KEY + "nonce", nonce)
    ranks = range(1, world)
    try:
        store.wait([f"{_KEY}hello/{r}" for r in ranks], timedelta(seconds=timeout_s))
    except RuntimeError as error:  # DistStoreError: the wait timed out
        missing = [r for r in ranks if not store.check([f"{_KEY}hello/{r}"])]
        raise GroupError(f"rank 0: rank(s) {missing} of the {world} did not join the group at {where} within "
                         f"{timeout_s:g}s ({RENDEZVOUS_TIMEOUT_ENV}); exiting so that the group is restarted") \
            from error
    refused = [r for r in ranks
               if not hmac.compare_digest(store.get(f"{_KEY}hello/{r}"), hello_proof(secret, nonce, world, r))]
    if refused:
        store.set(_KEY + "verdict", b"refused")
        raise AuthenticationError(f"rank 0: refused rank(s) {refused}: their hello failed authentication "
                                  f"(HMAC-SHA256 under the group secret); every rank must read the same "
                                  f"{SECRET_FILE_ENV} or {SECRET_ENV}")
    store.set(_KEY + "verdict", verdict_proof(secret, nonce, world))
    return nonce


def exit_rank(code: int) -> None:
    """Ends a process that joined a group, with `code`, skipping interpreter teardown: the process
    group's C++ threads abort the process (SIGABRT, "terminate called without an active exception")
    when they are destroyed after a peer has gone, and a supervisor must see the code the rank chose."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_local_workers(config: EngineConfig, port: int, secret: bytes) -> list[subprocess.Popen]:
    """Starts ranks 1..W-1 on this host, as `lockstep worker` processes that hold the leader's secret (in their
    environment: readable only by this user). They run by their module's name, not through the `lockstep`
    command, which is the package above the engine."""
    workers = []
    for rank in range(1, world_size(config)):
        env = dict(os.environ, LOCKSTEP_RANK=str(rank), LOCKSTEP_WORLD_SIZE=str(world_size(config)),
                   LOCKSTEP_LOCAL_RANK=str(rank), LOCKSTEP_LEADER_ADDR="127.0.0.1",
                   LOCKSTEP_RENDEZVOUS_PORT=str(port), LOCKSTEP_ENGINE_CONFIG=json.dumps(asdict(config)))
        env.pop(SECRET_FILE_ENV, None)
        env[SECRET_ENV] = secret.decode()
        workers.append(subprocess.Popen([sys.executable, "-m", "lockstep_engine.entrypoints.worker"], env=env,
                                        preexec_fn=die_with_parent))  # no orphaned workers
    atexit.register(stop_workers, workers)
    return workers


def stop_workers(workers: list[subprocess.Popen]) -> None:
    stop_processes(workers, timeout_s=10)


def listen_on_loopback() -> socket.socket:
    """The rendezvous listener of a group whose ranks all run on this host: bound to 127.0.0.1 only (a
    TCPStore of its own would listen on every interface), on a free port, held from now on (no race
    for the port between choosing and binding it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _tp_problem(tp: int, model) -> str | None:
    if model.num_attention_heads % tp:
        return f"does not divide the model's {model.num_attention_heads} attention heads"
    kv = model.num_key_value_heads
    if kv % tp and tp % kv:
        return f"neither divides nor is a multiple of the model's {kv} KV heads"
    if model.intermediate_size % tp:
        return f"does not divide the MLP size {model.intermediate_size}"
    return None


def check_layout(config: EngineConfig, model) -> None:
    """A layout the model cannot be split into is the user's flags: a ConfigError (one line, no
    traceback) naming the sizes that fit."""
    tp = config.tensor_parallel_size
    problem = _tp_problem(tp, model)
    if problem:
        fits = [size for size in range(1, model.num_attention_heads + 1) if _tp_problem(size, model) is None]
        raise ConfigError(f"tensor_parallel_size={tp} {problem} (expected one of {', '.join(map(str, fits))})")
    pp = config.pipeline_parallel_size
    if pp > model.num_hidden_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the model's {model.num_hidden_layers} layers "
                          f"(expected 1 to {model.num_hidden_layers})")
