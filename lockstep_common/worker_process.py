"""A spawned process that runs one function for a server, one call at a time, and that a crash
or a hang of that function cannot take the server down with it.

The engine's API process and the gateway hand work here that could stall their event loop (parsing a
16 MB body) or kill them (llguidance's native code on a user's grammar: a deep enough chain of rules
overflows its stack and the process dies with SIGSEGV). A call that crashes the worker fails
that call alone (`WorkerCrashed`); one that runs past its deadline has the worker killed
(`WorkerTimedOut`); the next call starts a fresh worker.

A worker dies with the process that started it: its main thread does nothing but read the pipe, so it
reads end of file the moment that process is gone (however it ended, SIGKILL included) and exits, and
no worker is left behind holding memory (the large-text worker holds a tokenizer, about 1 GB for some).
The function runs on a second thread, whose stack size the caller may choose.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
from typing import Any, Callable


class WorkerCrashed(RuntimeError):
    """The worker died while it ran the call (its exit code or signal in the message)."""


class WorkerTimedOut(RuntimeError):
    """The call ran past its deadline; the worker was killed."""


class WorkerUnavailable(RuntimeError):
    """The worker could not be started (no call was made: nothing to blame on an argument)."""


START_TIMEOUT_S = 60.0  # a spawned interpreter importing its function's module, on a loaded machine


class WorkerProcess:
    """One lazily spawned process running `function(argument)`; `call` blocks its (non-loop) thread."""

    def __init__(self, name: str, function: Callable[[Any], Any], initializer: Callable | None = None,
                 initargs: tuple = (), stack_bytes: int | None = None):
        self.name = name
        self._target = (function, initializer, initargs, stack_bytes)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._lock = threading.Lock()  # one call at a time: the pipe carries one exchange
        self.starts = 0  # processes started so far (a restart after a crash counts)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def call(self, argument: Any, timeout_s: float) -> Any:
        """`function(argument)` in the worker; its exception comes back as RuntimeError with its text."""
        with self._lock:
            conn = self._started()
            try:
                conn.send(argument)
            except OSError:
                raise WorkerCrashed(f"{self.name} crashed ({self._reap()})") from None
            if not conn.poll(timeout_s):
                self._stop()
                raise WorkerTimedOut(f"{self.name} did not finish within {timeout_s:g} s and was stopped")
            try:
                ok, result = conn.recv()
            except (EOFError, OSError):
                raise WorkerCrashed(f"{self.name} crashed ({self._reap()})") from None
        if not ok:
            raise RuntimeError(result)
        return result

    def close(self) -> None:
        with self._lock:
            self._stop()

    # ---- the process ---------------------------------------------------------------------------------
    def _started(self):
        if self._process is None or not self._process.is_alive():
            self._stop()
            context = multiprocessing.get_context("spawn")
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, *self._target), name=self.name, daemon=True)
            process.start()
            child.close()  # only the worker holds its end: its death is an end of file here
            self._process, self._conn = process, parent
            self.starts += 1
            try:
                ready = parent.poll(START_TIMEOUT_S) and parent.recv() == "ready"
            except (EOFError, OSError):
                ready = False
            if not ready:
                raise WorkerUnavailable(f"{self.name} did not start ({self._reap()})")
        return self._conn

    def _reap(self) -> str:
        process = self._process
        process.join(5)
        code = process.exitcode
        self._stop()
        if code is None:
            return "still running: stopped"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(5)
            self._process = None


def _serve(conn, function, initializer, initargs, stack_bytes) -> None:
    """The worker's main: the pipe read on this thread (end of file: the API process is gone), the calls
    run on another."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    if initializer is not None:
        initializer(*initargs)
    calls: queue.SimpleQueue = queue.SimpleQueue()
    if stack_bytes:
        threading.stack_size(stack_bytes)
    threading.Thread(target=_run_calls, args=(conn, function, calls), daemon=True).start()
    conn.send("ready")
    while True:
        try:
            calls.put(conn.recv())
        except (EOFError, OSError):
            os._exit(0)


def _run_calls(conn, function, calls: queue.SimpleQueue) -> None:
    while True:
        argument = calls.get()
        try:
            reply = (True, function(argument))
        except Exception as error:  # the caller decides what it means; the worker goes on
            reply = (False, f"{type(error).__name__}: {error}")
        conn.send(reply)
