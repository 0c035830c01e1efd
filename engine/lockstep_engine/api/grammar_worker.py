"""llguidance's checks of users' constraints, run in worker processes: a crash there fails one request.

llguidance is native code. Its compile of a user's JSON schema, regex or grammar recurses over the
grammar's rules; deep enough input overflowed the stack and killed `lockstep serve` with SIGSEGV,
every stream of the engine with it. guided_limits.py refuses the shapes known to do that before
llguidance starts; what gets past those bounds runs here, in `NUM_WORKERS` processes of their own
(worker_process.py), each call on a thread with a stack of `compile_stack_bytes()`, smaller than the
default stack of the engine core's grammar thread, which compiles the same grammar again with the
same library (guided.py): a grammar that passed here does not overflow there. A worker that dies
fails the request it was checking with a 400 and the next request starts a new worker; one that
runs past `MAX_COMPILE_S` is killed.

`check_spec` is what a worker runs; a test plants a crash by replacing it before the server starts
(tests/api/planted_grammar_crash.py).
"""

from __future__ import annotations

import queue
import resource

from lockstep_common.worker_process import WorkerCrashed, WorkerProcess, WorkerTimedOut
from lockstep_engine.guided_schema import GuidedDecodingError, check_guided
from lockstep_engine.log import log

NUM_WORKERS = 2
MAX_COMPILE_S = 60.0  # a check still running then is stopped: its worker is killed
_DEFAULT_THREAD_STACK = 2 << 20  # glibc's thread stack when RLIMIT_STACK is unlimited (x86_64, aarch64)


def compile_stack_bytes() -> int:
    """Half the default stack of a new thread (glibc takes RLIMIT_STACK's soft limit, 8 MiB on most
    systems), between 1 and 4 MiB: the core's grammar thread has the default."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    default = _DEFAULT_THREAD_STACK if soft == resource.RLIM_INFINITY else soft
    return max(1 << 20, min(4 << 20, default // 2))


def check_spec(spec: dict) -> str | None:
    """In a worker: why `spec` cannot guide a generation, or None."""
    try:
        check_guided(spec)
    except GuidedDecodingError as failure:
        return str(failure)
    except Exception as failure:  # llguidance failing in a way it does not report as a bad grammar
        return f"the constraint cannot be compiled ({type(failure).__name__})"
    return None


class GrammarWorkers:
    """`NUM_WORKERS` worker processes, started on first use; `check` blocks its (non-loop) thread."""

    def __init__(self, num_workers: int = NUM_WORKERS):
        self._idle: queue.SimpleQueue[WorkerProcess] = queue.SimpleQueue()
        self.workers = [WorkerProcess(f"grammar worker {i}", check_spec, stack_bytes=compile_stack_bytes())
                        for i in range(num_workers)]
        for worker in self.workers:
            self._idle.put(worker)

    def check(self, spec: dict, timeout_s: float = MAX_COMPILE_S) -> str | None:
        """Why `spec` cannot guide a generation, or None; a crash or a timeout is the spec's fault."""
        worker = self._idle.get()
        try:
            return worker.call(spec, timeout_s)
        except WorkerCrashed as crash:
            log(f"error: {crash} while it checked a {next(iter(spec), '?')} constraint; the request gets a 400 and "
                f"the next check starts a new worker")
            return ("the grammar compiler crashed on this constraint (it is too large or too deeply nested for "
                    "llguidance); simplify it")
        except WorkerTimedOut:
            return f"the constraint did not compile within {timeout_s:g} s (a smaller schema or a simpler grammar)"
        finally:
            self._idle.put(worker)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.close()
