"""How every Lockstep program ends its child processes, `subprocess.Popen` and `multiprocessing.Process` alike:
SIGTERM, a bounded wait, then SIGKILL (a child's tie to its parent is `lockstep_common.sockets.die_with_parent`)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable


def stop_processes(processes: Iterable, timeout_s: float) -> None:
    """SIGTERM to each process still running, then at most `timeout_s` seconds (for all of them together) to exit;
    those still running then get SIGKILL. Every one is reaped before this returns."""
    processes = list(processes)
    for process in processes:
        if _is_running(process):
            process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        _wait(process, max(0.0, deadline - time.monotonic()))
    for process in processes:
        if _is_running(process):
            process.kill()
            _wait(process, None)


def _is_running(process) -> bool:
    if isinstance(process, subprocess.Popen):
        return process.poll() is None
    return process.pid is not None and process.is_alive()


def _wait(process, timeout_s: float | None) -> None:
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    elif process.pid is not None:
        process.join(timeout_s)
