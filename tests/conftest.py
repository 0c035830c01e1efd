import os

import torch

# Two cores: one intra-op thread per engine keeps OpenMP from spin-waiting against other processes.
os.environ.setdefault("LOCKSTEP_CPU_THREADS", "1")
# Without CUDA the kernel tests run Triton's interpreter, chosen when a function is decorated: Triton's own
# library functions too, and test modules collected before tests/kernels import Triton already (peft does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from directory_scope import pytest_runtest_teardown  # noqa: E402,F401  (the hook: see directory_scope.py)


@pytest.fixture(scope="session")
def peft_reference(tmp_path_factory):
    """Two PEFT LoRA adapters for SmolLM2 on disk and transformers + peft's greedy reference
    (tests/lora_peft.py), made once for every LoRA test of the session."""
    pytest.importorskip("peft")
    from lora_peft import PeftReference

    return PeftReference(str(tmp_path_factory.mktemp("lora-adapters")))
