"""The spawn target of the engine-core process, resolved by name so the API process stays torch-free.

The core's module imports torch, the model and the runner; the API server never needs them, and
importing them would add torch's import time and memory to it. `run_core` is what the API server
hands to `multiprocessing` (which pickles it by module and name); only the child imports the core
module, when it runs it (the import-linter contract on `lockstep_engine.api` forbids importing it).
"""

from __future__ import annotations

import importlib

CORE_ENTRY_POINT = "lockstep_engine.core_process:run_engine_core"


def run_core(entry_point: str, *args) -> None:
    """Runs `module:function` with `args` (in the spawned child)."""
    module_name, function_name = entry_point.split(":")
    getattr(importlib.import_module(module_name), function_name)(*args)
