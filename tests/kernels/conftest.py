"""Kernel tests run on the GPU when there is one, else in Triton's interpreter (TRITON_INTERPRET=1).

The interpreter is chosen when a kernel is decorated, so the variable must be set before
lockstep_engine.kernels is imported: this conftest runs first.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Run from a bare checkout too (the GPU machine has no installed lockstep package).
_ENGINE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "engine")
try:
    import lockstep_engine  # noqa: F401
except ImportError:
    sys.path.insert(0, _ENGINE)
