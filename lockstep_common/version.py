"""The version every Lockstep program reports: the installed `lockstep` distribution's (pyproject.toml).

One answer for the engine, the gateway and the `lockstep` command, read from package metadata so that
none of them imports another to learn it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "lockstep"


def distribution_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0+unknown"
