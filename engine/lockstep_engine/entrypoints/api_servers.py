"""`lockstep serve --api-server-count N` (N > 1): N API-server processes on one port, feeding one engine core.

The process `lockstep serve` started is the supervisor; it serves nothing itself. It reserves the port with a
bound (not listening) SO_REUSEPORT socket (so `--port 0` works too), makes a run directory, makes one duplex
pipe per API server, spawns the engine core with one end of each (core_process.run_engine_core_for_api_servers,
by name: this process never imports torch), then starts N API servers: the same command line with
`--api-server-index I`, the other end of pipe I, and the run directory. Each API server binds its own
listening SO_REUSEPORT socket on the port, behind its own health listener; the kernel spreads new connections
over them (by a hash of the connection's addresses) and a connection stays with the server that accepted it.
Each API server tokenizes, detokenizes and streams its own requests; the core schedules all of them in one
batch and sends each request's outputs back to its server (core_clients.py). The API-server-side metrics are
summed over the servers, and /health is 200 only when all of them are ready (api/peers.py).

Failures, with bounded waits throughout:
* An API server that exits by itself (a crash, kill -9) stops the whole `lockstep serve`: the core aborts that
  server's requests at once (its pipe closed), the supervisor removes its metrics file (so /health through
  the others says 503 at once) and sends SIGTERM to the other servers, which drain as on a SIGTERM of
  `lockstep serve`, and exits 1 once every process is gone, so that its own supervisor (Kubernetes, systemd,
  `lockstep up`) restarts it whole. A restart of the lost server alone is not done: a fresh server would need
  a new pipe to the running core, and the whole group restarts in the time the model takes to load.
* A core that dies: every API server fails its requests in flight and exits 1 (its pipe reads as closed, or
  its heartbeat stops), and the supervisor exits 1.
* SIGTERM (or SIGINT) to the supervisor: SIGTERM to every API server (each drains within
  `--shutdown-grace-period`), then the core stops when the last has left; exit 0. A second signal stops the
  API servers at once. What is still running `STOP_MARGIN_S` past the grace period is killed.
The API servers get SIGTERM when the supervisor dies, however it dies (Linux), and ignore a terminal's SIGINT
(the supervisor passes it on); the core ignores SIGINT and stops when its API servers have gone.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from lockstep_common.sockets import bind_sockets, die_with_parent
from lockstep_common.supervisor import Supervisor
from lockstep_engine.api import core_launch
from lockstep_engine.api.peers import ApiServerGroup
from lockstep_engine.log import log

CORE_ENTRY_POINT = "lockstep_engine.core_process:run_engine_core_for_api_servers"
STOP_MARGIN_S = 15.0  # past the drain's grace period: uvicorn's own shutdown, the core's
POLL_S = 0.1


def supervise(argv: list[str], host: str, port: int, count: int, config, grace_s: float) -> int:
    """Runs the engine core and `count` API servers of `lockstep serve argv` until a signal or a death."""
    try:
        reserved = bind_sockets(host, port, None, reuse_port=True)
    except OSError as error:
        log(f"error: --port {port}: cannot listen on {host}: {error} (is the port taken?)")
        return 1
    port = reserved[0].getsockname()[1]
    run_dir = tempfile.mkdtemp(prefix="lockstep-serve-")
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=True) for _ in range(count)]
    core = ctx.Process(target=core_launch.run_core, args=(CORE_ENTRY_POINT, config, [ours for ours, _ in pipes]),
                       name="lockstep-engine-core")
    code = 0
    indexes: dict[str, int] = {}  # each API server's index, by its name in the supervisor

    def exited(name: str, status: int, stopping: bool) -> None:
        nonlocal code
        if not stopping:
            log(f"error: {name} exited with {status}; stopping lockstep serve")
            _forget(run_dir, indexes[name])
            code = 1
        elif status != 0 and status != -signal.SIGTERM:
            code = 1

    def core_alive() -> bool:
        nonlocal code
        alive = core.is_alive()
        if not alive and not group.stopping:
            log(f"error: the engine core exited with {core.exitcode}; stopping lockstep serve")
            code = 1
            group.stop()
        return alive

    def past_deadline() -> None:
        nonlocal code
        log("error: processes left past the shutdown deadline: killing them")
        code = 1

    try:
        with Supervisor(grace_s + STOP_MARGIN_S, POLL_S) as group:
            core.start()
            for ours, _ in pipes:
                ours.close()
            for index, (_, theirs) in enumerate(pipes):
                server = subprocess.Popen(
                    [sys.executable, "-m", "lockstep_engine.entrypoints.serve", *argv, "--port", str(port),
                     "--api-server-index", str(index), "--engine-core-fd", str(theirs.fileno()), "--run-dir", run_dir],
                    stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()], preexec_fn=die_with_parent)
                theirs.close()
                name = f"API server {index} (pid {server.pid})"
                indexes[name] = index
                group.add(name, server)
            log(f"{count} API servers on {host}:{port} (pids {', '.join(str(s.pid) for s in group.children.values())}), "
                f"engine core pid {core.pid}")
            group.run(exited, core_alive, past_deadline)
    finally:
        if core.pid is not None and core.is_alive():
            core.kill()
        if core.pid is not None:
            core.join(10.0)
        for sock in reserved:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def api_server_group(index: int, count: int, run_dir: str, core_fd: int) -> ApiServerGroup:
    """What an API server started by `supervise` is given (its hidden flags), with its pipe to the core."""
    from multiprocessing.connection import Connection

    os.set_inheritable(core_fd, False)
    return ApiServerGroup(index, count, run_dir, Connection(core_fd))


def _forget(run_dir: str, index: int) -> None:
    try:
        os.remove(ApiServerGroup(index, 0, run_dir).path(index))
    except OSError:
        pass
