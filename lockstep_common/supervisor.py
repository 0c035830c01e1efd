"""How a Lockstep program supervises the processes that serve with it (`lockstep gateway --workers N`,
`lockstep serve --api-server-count N`): they live and stop together.

* SIGTERM or SIGINT to the supervisor is passed to every child as SIGTERM, once; a second signal is
  passed on again (children that drain on the first take the second as "now").
* A child that exits by itself stops the others: the owner's `on_exit` says what that means (an exit code,
  a log line), and every other child gets SIGTERM, so that the supervisor's own supervisor (Kubernetes,
  systemd) restarts the whole set rather than a part of it serving on.
* What still runs `stop_timeout_s` after stopping began is killed, and every child is reaped before `run`
  returns, whatever happens.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable


class Supervisor:
    """`with Supervisor(timeout) as group:` installs the signal handlers (so a signal while the children
    start is not lost), `group.add` each child, `group.run(...)`; leaving the block kills and reaps what
    still runs and puts the previous handlers back."""

    def __init__(self, stop_timeout_s: float, poll_s: float = 0.1):
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.children: dict[str, subprocess.Popen] = {}  # the running ones, by the owner's name for them
        self.deadline: float | None = None  # set once stopping began
        self._previous: dict = {}

    def __enter__(self) -> "Supervisor":
        self._previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *_) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.kill()
            child.wait()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def stopping(self) -> bool:
        return self.deadline is not None

    def add(self, name: str, child: subprocess.Popen) -> None:
        self.children[name] = child

    def stop(self, sig: int | None = None, _frame=None) -> None:
        """Begins stopping (SIGTERM to every child); a signal that arrives while stopping is passed on too."""
        if self.stopping and sig is None:
            return
        if not self.stopping:
            self.deadline = time.monotonic() + self.stop_timeout_s
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def run(self, on_exit: Callable[[str, int, bool], None], tick: Callable[[], bool] = lambda: False,
            on_deadline: Callable[[], None] = lambda: None) -> None:
        """Until every child has exited and `tick()` (called every poll: the owner's own checks, e.g. of a
        process it tracks itself) returns false: each exit is reported once to `on_exit(name, status,
        stopping)`, and one while not stopping stops the rest. Past the deadline `on_deadline()` is called
        and `run` returns (leaving the `with` block kills what still runs)."""
        while True:
            for name, child in list(self.children.items()):
                status = child.poll()
                if status is None:
                    continue
                del self.children[name]
                stopping = self.stopping
                on_exit(name, status, stopping)
                if not stopping:
                    self.stop()
            busy = tick()
            if not self.children and not busy:
                return
            if self.stopping and time.monotonic() > self.deadline:
                on_deadline()
                return
            time.sleep(self.poll_s)
