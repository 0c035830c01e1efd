"""The gateway: an OpenAI-compatible front door over engine groups.

It imports nothing from the `lockstep` package (whose `lockstep up` starts it) and nothing from the
engine: the dependency runs one way, `lockstep` -> `lockstep_gateway` (pyproject's import-linter contracts).
"""

from lockstep_common.version import distribution_version

__version__ = distribution_version()  # the distribution this package ships in
