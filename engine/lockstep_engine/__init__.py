"""The engine: `lockstep serve`, the offline `LLM`, and everything from the scheduler to the kernels.

It imports nothing from the `lockstep` package (the command line that starts it): its version comes
from the installed distribution, like the gateway's.
"""

from lockstep_common.version import distribution_version

__version__ = distribution_version()
