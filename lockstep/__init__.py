"""Lockstep: Kubernetes-native LLM serving with multi-step decode.

`from lockstep import LLM, SamplingParams` is the offline API; it is resolved lazily so that the
gateway and operator images, which have no torch, can import this package.
"""

from lockstep_common.version import distribution_version

__version__ = distribution_version()

_LAZY = {"LLM": "lockstep_engine.llm", "SamplingParams": "lockstep_engine.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
