"""`lockstep serve` with a crash planted in its grammar workers: checking the regex `PLANTED_REGEX` kills the
worker with SIGSEGV, as llguidance's native code did on a deep enough grammar. The request must fail alone
(a 400), the server and its other streams must go on, and the next grammar must be served by a new worker.

Run as `python tests/api/planted_grammar_crash.py serve MODEL ...` (the arguments of `lockstep`). The workers
are spawned processes: they find `planted` in this script, which they import as their main module."""

from __future__ import annotations

import os
import signal
import sys

from lockstep.cli import main
from lockstep_engine.api import grammar_worker

PLANTED_REGEX = "planted-crash"
_check_spec = grammar_worker.check_spec


def planted(spec: dict) -> str | None:
    if spec == {"regex": PLANTED_REGEX}:
        os.kill(os.getpid(), signal.SIGSEGV)
    return _check_spec(spec)


if __name__ == "__main__":
    grammar_worker.check_spec = planted
    sys.exit(main())
