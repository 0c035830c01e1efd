"""How every Lockstep program writes its log: stdlib `logging`, one line per record on stderr, configured here.

The engine writes `[lockstep] message` (what `lockstep up`, the operator and people grep for), the gateway
`[lockstep gateway] LEVEL message`, the operator a timestamped line; each picks its format and calls
`configure_logging`, which is safe to call again (it replaces its own handler, so no line is written twice).
"""

from __future__ import annotations

import logging
import sys


class StderrHandler(logging.StreamHandler):
    """Writes to the `sys.stderr` of the moment (a redirect or a test's capture included), flushed per record."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(fmt))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass  # always the current sys.stderr


def configure_logging(fmt: str, level: int | str = logging.INFO, logger: str | None = None) -> logging.Logger:
    """Records of `logger` (None: the root logger) at `level` and above go to stderr as `fmt`, through one
    `StderrHandler`. A named logger stops propagating, so a program that also configures the root logger (or a
    library user's application) does not print its lines twice."""
    target = logging.getLogger(logger)
    handlers = [handler for handler in target.handlers if not isinstance(handler, StderrHandler)]
    target.handlers = [*handlers, StderrHandler(fmt)]
    target.setLevel(level.upper() if isinstance(level, str) else level)
    if logger is not None:
        target.propagate = False
    return target
