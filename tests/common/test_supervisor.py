"""lockstep_common.supervisor on real child processes: a child that exits stops the rest, a signal to the
supervisor is passed on, what ignores SIGTERM is killed at the deadline, and nothing is left unreaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from lockstep_common.supervisor import Supervisor

SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def _start(code: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"  # its signal handling is set up
    return child


def test_a_child_that_exits_stops_the_others_and_each_exit_is_reported_once():
    exits = []
    started = time.monotonic()
    with Supervisor(stop_timeout_s=20) as group:
        sleepers = [_start(SLEEPER) for _ in range(2)]
        for index, child in enumerate(sleepers):
            group.add(f"sleeper {index}", child)
        group.add("quitter", subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
        group.run(lambda name, status, stopping: exits.append((name, status, stopping)))
    assert exits[0] == ("quitter", 3, False), exits
    assert sorted(exits[1:]) == [("sleeper 0", -signal.SIGTERM, True), ("sleeper 1", -signal.SIGTERM, True)], exits
    assert time.monotonic() - started < 15
    assert all(child.returncode is not None for child in sleepers)


def test_a_signal_to_the_supervisor_reaches_every_child_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    exits = []
    with Supervisor(stop_timeout_s=20) as group:
        for index in range(2):
            group.add(f"sleeper {index}", _start(SLEEPER))
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        group.run(lambda name, status, stopping: exits.append((name, status, stopping)))
    assert sorted(exits) == [("sleeper 0", -signal.SIGTERM, True), ("sleeper 1", -signal.SIGTERM, True)], exits
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_child_that_ignores_sigterm_is_killed_at_the_deadline_and_reaped():
    deadline_hits = []
    busy_calls = []
    with Supervisor(stop_timeout_s=0.5) as group:
        stubborn = _start(STUBBORN)
        group.add("stubborn", stubborn)
        group.add("quitter", subprocess.Popen([sys.executable, "-c", "pass"]))
        started = time.monotonic()
        group.run(lambda *_: None, tick=lambda: busy_calls.append(1) or False,
                  on_deadline=lambda: deadline_hits.append(time.monotonic() - started))
    assert len(deadline_hits) == 1 and 0.4 < deadline_hits[0] < 10, deadline_hits
    assert stubborn.returncode == -signal.SIGKILL
    assert busy_calls  # the owner's own check ran every poll


def test_tick_keeps_the_supervisor_running_while_the_owner_says_so():
    """The owner's own process (the engine core, a multiprocessing.Process) keeps `run` going after the
    children have gone, until `tick` says it has ended too."""
    ticks = []
    with Supervisor(stop_timeout_s=20) as group:
        group.add("quitter", subprocess.Popen([sys.executable, "-c", "pass"]))
        group.run(lambda *_: None, tick=lambda: ticks.append(1) or len(ticks) < 5)
    assert len(ticks) == 5
