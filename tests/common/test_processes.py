"""How children are ended (lockstep_common/processes.py): SIGTERM, a bounded wait, SIGKILL, on real processes."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import time

from lockstep_common.processes import stop_processes

# Prints once its SIGTERM handler is in place, so the test knows the signal will find it.
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def _child(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_a_child_that_obeys_sigterm_ends_with_it():
    process = _child("import time; print('ready', flush=True); time.sleep(60)")
    started = time.monotonic()
    stop_processes([process], timeout_s=30)
    assert process.returncode == -signal.SIGTERM
    assert time.monotonic() - started < 10


def test_a_child_that_ignores_sigterm_is_killed_once_the_wait_is_over():
    processes = [_child(IGNORES_SIGTERM), _child(IGNORES_SIGTERM)]
    started = time.monotonic()
    stop_processes(processes, timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert [process.returncode for process in processes] == [-signal.SIGKILL, -signal.SIGKILL]
    assert 0.5 <= elapsed < 10  # one wait for both, not one each


def test_a_child_that_has_exited_keeps_its_exit_code():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait(30)
    stop_processes([process], timeout_s=5)
    assert process.returncode == 3


def _sleep() -> None:
    time.sleep(60)


def test_a_multiprocessing_child_is_ended_too_and_one_never_started_is_left_alone():
    context = multiprocessing.get_context("spawn")
    running, never_started = context.Process(target=_sleep), context.Process(target=_sleep)
    running.start()
    stop_processes([running, never_started], timeout_s=30)
    assert running.exitcode == -signal.SIGTERM and never_started.pid is None
