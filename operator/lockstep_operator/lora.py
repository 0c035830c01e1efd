"""spec.lora and spec.loraAdapters: the engine's LoRA settings and the adapters every group serves.

The adapter list never enters the engine pods' template (so it never restarts a group): the operator
writes it into the LLMService's ConfigMap (`lora-adapters.json`, mounted at /etc/lockstep), and in every
engine pod `lora_sync.py` fetches what it names and, on the leader, loads and unloads adapters through
the engine's run-time routes. Only what the pods need at start enters the template: the engine flags,
and a read-only mount per PersistentVolumeClaim an adapter comes from (a new claim is a new volume, so
it rolls the groups as any template change does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep_operator.constants import CACHE_DIR, MODELS_DIR
from lockstep_operator.errors import SpecError
from lockstep_operator.names import digest
from lockstep_operator.sources import ARCHIVE_SUFFIXES, check_form, is_fetched, pvc_claim, url_file_name

# Flags the operator sets from spec.lora (and the adapter list it loads at run time instead of
# --lora-modules); spec.engine.extraArgs may not repeat them.
LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules")
# The ranks vLLM's --max-lora-rank accepts.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_ADAPTERS = 64
MAX_LORAS = 64
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
# An adapter's name is the `model` clients send: lowercase letters, digits, '-', '.' and '_'.
ADAPTER_NAME_RE = re.compile(r"^[a-z0-9]([-._a-z0-9]*[a-z0-9])?$")
MAX_ADAPTER_NAME_LENGTH = 63
# Where pods fetch hf:// and URL adapters (inside the writable cache volume), one directory per source.
FETCHED_ADAPTERS_DIR = f"{CACHE_DIR}/lora-adapters"
ADAPTERS_FILE_KEY = "lora-adapters.json"


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    source: str

    @property
    def path(self) -> str:
        """Where the adapter's directory is inside an engine pod."""
        claim = pvc_claim(self.source)
        if claim is not None:
            return f"{MODELS_DIR}/{claim}" + self.source[len("pvc://") + len(claim) :]
        return f"{FETCHED_ADAPTERS_DIR}/{digest(self.source, 16)}"


@dataclass(frozen=True)
class LoraConfig:
    max_loras: int
    max_lora_rank: int
    adapters: tuple[LoraAdapter, ...]

    @property
    def claims(self) -> tuple[str, ...]:
        """The PersistentVolumeClaims adapters come from, sorted (the order of the list does not matter)."""
        return tuple(sorted({c for c in (pvc_claim(a.source) for a in self.adapters) if c is not None}))


def engine_args(config: LoraConfig) -> list[str]:
    # --max-cpu-loras bounds the adapters the engine registers (a load past it is refused): room for the
    # longest list the CRD allows, so the bound never depends on the list (which would restart groups).
    return ["--enable-lora", "--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank),
            "--max-cpu-loras", str(max(config.max_loras, MAX_ADAPTERS))]


def adapters_file(config: LoraConfig) -> str:
    """The ConfigMap key lora_sync.py reads: every adapter's name, source, and path in the pod."""
    adapters = [{"name": a.name, "source": a.source, "path": a.path} for a in sorted(config.adapters, key=lambda a: a.name)]
    return json.dumps({"adapters": adapters}, indent=1, sort_keys=True) + "\n"


def _check_int(raw: Mapping[str, Any], key: str, default: int, allowed: str, ok: Any) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise SpecError(f"spec.lora.{key}", f"must be {allowed}, got {value!r}")
    return value


def _check_adapter(index: int, raw: Any, served_name: str) -> LoraAdapter:
    field = f"spec.loraAdapters[{index}]"
    if not isinstance(raw, Mapping):
        raise SpecError(field, f"must be an object with name and source, got {raw!r}")
    unknown = sorted(set(raw) - {"name", "source"})
    if unknown:
        raise SpecError(f"{field}.{unknown[0]}", "is not a field; expected name, source")
    name = raw.get("name")
    if not isinstance(name, str) or len(name) > MAX_ADAPTER_NAME_LENGTH or not ADAPTER_NAME_RE.match(name):
        raise SpecError(f"{field}.name", f"must be at most {MAX_ADAPTER_NAME_LENGTH} lowercase letters, digits, '-', "
                                         f"'.' or '_', starting and ending with a letter or digit, got {name!r}")
    if name == served_name:
        raise SpecError(f"{field}.name", f"must differ from the served model name ({served_name!r}): clients "
                                         "tell the base model from an adapter by this name")
    source = raw.get("source")
    kinds = "pvc://<claim>/<path>, hf://<org>/<repo>[@<revision>] or an http(s):// URL of a .tar, .tar.gz or .tgz archive"
    if not isinstance(source, str) or not (source.startswith("pvc://") or is_fetched(source)):
        raise SpecError(f"{field}.source", f"must be {kinds}, got {source!r}")
    check_form(source, f"{field}.source")
    if source.startswith(("http://", "https://")) and not url_file_name(source).endswith(ARCHIVE_SUFFIXES):
        raise SpecError(f"{field}.source", f"must be an archive (.tar, .tar.gz or .tgz) of the adapter's directory, "
                                           f"got {source!r}")
    return LoraAdapter(name=name, source=source)


def check_lora(lora: Any, adapters: Any, served_name: str) -> LoraConfig | None:
    """spec.lora and spec.loraAdapters, the CRD's rules again. LoRA is on when either is set."""
    if lora is None and not adapters:
        return None
    if lora is None:
        lora = {}
    if not isinstance(lora, Mapping):
        raise SpecError("spec.lora", f"must be an object, got {type(lora).__name__}")
    unknown = sorted(set(lora) - {"maxLoras", "maxLoraRank"})
    if unknown:
        raise SpecError(f"spec.lora.{unknown[0]}", "is not a field; expected maxLoras, maxLoraRank")
    max_loras = _check_int(lora, "maxLoras", DEFAULT_MAX_LORAS, f"an integer in 1..{MAX_LORAS}", lambda v: 1 <= v <= MAX_LORAS)
    rank = _check_int(lora, "maxLoraRank", DEFAULT_MAX_LORA_RANK, f"one of {', '.join(map(str, LORA_RANKS))}",
                      lambda v: v in LORA_RANKS)  # fmt: skip
    if adapters is None:
        adapters = []
    if not isinstance(adapters, list):
        raise SpecError("spec.loraAdapters", f"must be a list of {{name, source}} objects, got {type(adapters).__name__}")
    if len(adapters) > MAX_ADAPTERS:
        raise SpecError("spec.loraAdapters", f"must hold at most {MAX_ADAPTERS} adapters, got {len(adapters)}")
    checked = tuple(_check_adapter(i, raw, served_name) for i, raw in enumerate(adapters))
    seen: set[str] = set()
    for i, adapter in enumerate(checked):
        if adapter.name in seen:
            raise SpecError(f"spec.loraAdapters[{i}].name", f"{adapter.name!r} is listed twice; names must be unique")
        seen.add(adapter.name)
    return LoraConfig(max_loras=max_loras, max_lora_rank=rank, adapters=checked)
