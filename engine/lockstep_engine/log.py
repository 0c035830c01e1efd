"""`log`: the engine's one-line progress and error messages on stderr, as `[lockstep] message`.

A module of its own, with no torch, so the API-server process logs without importing the model
loaders. The `[lockstep]` prefix is what `lockstep up` and its tests look for in an engine's output.
"""

from __future__ import annotations

import sys


def log(message: str) -> None:
    print(f"[lockstep] {message}", file=sys.stderr, flush=True)
