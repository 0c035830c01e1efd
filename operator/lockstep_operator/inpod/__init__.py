"""The programs engine pods run, kept as real modules: `launch.py` (the engine container's command and
its probes), `fetch.py` (the `fetch-model` init container) and `lora_sync.py` (started by the launcher
when the service has LoRA adapters: keeps the engine's adapters in step with the ConfigMap's list).

The operator does not rely on the engine image holding them: it puts their source text into the
LLMService's ConfigMap (`LAUNCHER`, `FETCHER`, `LORA_SYNC`), mounted at /etc/lockstep, and the pods run it with the
engine image's python3. So they import nothing beyond the standard library, and a pod always runs the
programs of the operator that built it (their text enters the group revision).
"""

from importlib import resources


def source(name: str) -> str:
    """The text of one of this package's programs, as it goes into the ConfigMap."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


LAUNCHER = source("launch.py")
FETCHER = source("fetch.py")
LORA_SYNC = source("lora_sync.py")
