"""`log`: the engine's one-line progress and error messages on stderr, as `[lockstep] message`.

Stdlib logging under the `lockstep_engine` logger, configured by lockstep_common.logs the first time a process
imports this module (the API server, the engine core and every rank import it), so an application that
embeds the offline `LLM` can raise its level or add handlers like any other library's. A module of its own,
with no torch, so the API-server process logs without importing the model loaders. The `[lockstep]`
prefix is what `lockstep up` and its tests look for in an engine's output.
"""

from __future__ import annotations

import logging

from lockstep_common.logs import configure_logging

LOG_FORMAT = "[lockstep] %(message)s"
logger = configure_logging(LOG_FORMAT, logging.INFO, "lockstep_engine")


def log(message: str) -> None:
    """A message that starts with "error:" or "warning:" is logged at that level, any other at INFO."""
    level = logging.ERROR if message.startswith("error") else logging.WARNING if message.startswith("warning") \
        else logging.INFO
    logger.log(level, message)
