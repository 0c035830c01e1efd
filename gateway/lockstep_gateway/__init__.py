"""The gateway: an OpenAI-compatible front door over engine groups.

It imports nothing from the `lockstep` package (whose `lockstep up` starts it) and nothing from the
engine: the dependency runs one way, `lockstep` -> `lockstep_gateway` (pyproject's import-linter contracts).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lockstep")  # the distribution this package ships in
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"
