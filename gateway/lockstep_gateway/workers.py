"""`lockstep gateway --workers N`: N gateway processes serving one port, and the supervisor that runs them.

The process `lockstep gateway` started is the supervisor. It reserves the port with a bound (not
listening) SO_REUSEPORT socket, so `--port 0` works too, then starts N workers: the same command line
with `--worker-index I`, each binding its own listening SO_REUSEPORT socket on that port. The kernel
spreads new connections over the listening sockets (by a hash of the connection's addresses); a
connection stays with the worker that accepted it.

Each worker is a whole gateway: its own health checks and load scrapes of every engine, its own
count of the requests it has open on each engine (so routing sees its own load exactly and the others'
through the engines' scraped gauges, as it sees other gateway replicas), and its own admission limit,
queue, rate-limit buckets, retry budget and circuit breakers: every such limit is per worker.
Prometheus metrics are written by every worker into a directory the supervisor creates
(prometheus_client's multiprocess mode); `/metrics` of any worker reports the sum over workers.

The workers are supervised as `lockstep_common.supervisor` does for every such set: SIGTERM or SIGINT to
the supervisor is passed to every worker as SIGTERM (a second one again); each drains as a one-process
gateway does, and the supervisor exits when they have (SIGKILL after `STOP_TIMEOUT_S`). A worker that
exits by itself stops the gateway: the supervisor stops the others and exits with that worker's code
(1 if it was 0), so that its supervisor (Kubernetes, systemd) restarts it whole rather than serving on
fewer cores than it was given. Workers get SIGTERM when the supervisor dies, however it dies (Linux).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile

from lockstep_common.sockets import bind_sockets, die_with_parent
from lockstep_common.supervisor import Supervisor

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when imported
STOP_TIMEOUT_S = 30.0
log = logging.getLogger("lockstep.gateway")


def supervise(argv: list[str], host: str, port: int, workers: int) -> int:
    """Runs `workers` workers of `lockstep gateway argv` on host:port until a signal or a worker's exit."""
    try:
        reserved = bind_sockets(host, port, None, reuse_port=True)
    except OSError as error:
        log.error("cannot bind %s:%d: %s", host, port, error)
        return 1
    port = reserved[0].getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="lockstep-gateway-metrics-")
    env = {**os.environ, MULTIPROC_ENV: metrics_dir}
    code = 0

    def exited(name: str, status: int, stopping: bool) -> None:
        nonlocal code
        if not stopping:
            log.error("gateway %s exited with %d; stopping the gateway", name, status)
            code = status or 1
        elif status and not code:
            code = status if status > 0 else 0  # -SIGTERM after our SIGTERM is a clean stop

    try:
        with Supervisor(STOP_TIMEOUT_S) as group:
            for index in range(workers):
                # A session of its own: a terminal's Ctrl-C reaches the supervisor alone, which stops the workers.
                child = subprocess.Popen([sys.executable, "-m", "lockstep_gateway.main", *argv, "--port", str(port),
                                          "--worker-index", str(index)], env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent)
                group.add(f"worker {index} (pid {child.pid})", child)
            log.info("starting %d workers on http://%s:%d", workers, host, port)
            group.run(exited)
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code
