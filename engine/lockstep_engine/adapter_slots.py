"""LoRA adapters on the scheduler's side: which adapters are registered, and which sit in the model's
weight slots. Plain Python, no torch (the scheduler and the API-facing core read it).

The model holds `max_loras` adapters at once in slots 1..max_loras (slot 0 is the base model: zeros).
A sequence takes its adapter's slot when it is admitted and gives it up when it finishes or is
preempted; a slot whose adapter no sequence uses can take another adapter, which the plan of that
window loads first (`WindowPlan.lora_loads`). A batch therefore never holds more than `max_loras`
distinct adapters, and a slot is rewritten only while nothing scheduled reads it.

Registering and unregistering change only what new requests may name: a request keeps the
`Adapter` it arrived with, so unloading an adapter lets its requests in flight finish on its weights.
Every registration gets a new id, the root of its sequences' prefix-cache hashes: blocks computed with
one adapter (or an earlier adapter of the same name) never serve another's prefix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

_adapter_ids = itertools.count(1)


class AdapterNotFound(ValueError):
    param = "model"


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    adapter_id: int = field(default_factory=lambda: next(_adapter_ids))


class AdapterSlots:
    def __init__(self, max_loras: int, max_cpu_loras: int):
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.registered: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * (max_loras + 1)  # index 0: the base model, never used
        self._users = [0] * (max_loras + 1)
        self._last_used = [0] * (max_loras + 1)
        self._clock = itertools.count(1)
        self.pending_loads: list[tuple[int, Adapter]] = []  # for the next plan: (slot, adapter) to load first

    @classmethod
    def start(cls, config, check: Callable[[str, str], object]) -> AdapterSlots | None:
        """The slot table of an `EngineConfig` with --enable-lora (None without), its --lora-modules registered
        (an adapter that cannot be used fails the start)."""
        if not config.enable_lora:
            return None
        slots = cls(config.max_loras, config.max_cpu_loras)
        for name, path in config.lora_modules:
            slots.load(name, path, check)
        return slots

    # ---- registry ---------------------------------------------------------------------------
    def register(self, name: str, path: str) -> Adapter:
        """A new adapter for requests to name (the caller has checked its files). ValueError naming the
        reason for a name in use or a full registry."""
        if name in self.registered:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if len(self.registered) >= self.max_cpu_loras:
            raise ValueError(f"{len(self.registered)} LoRA adapters are loaded, the most --max-cpu-loras="
                             f"{self.max_cpu_loras} allows; unload one first")
        adapter = self.registered[name] = Adapter(name, path)
        return adapter

    def load(self, name: str, path: str, check: Callable[[str, str], object]) -> Adapter:
        """Registers an adapter after `check(name, path)` (reads and checks its files; raises a ValueError
        naming what is wrong) passed."""
        if name in self.registered:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        check(name, path)
        return self.register(name, path)

    def resolve(self, name: str | None) -> Adapter | None:
        """The registered adapter a request names (None: the base model); ValueError for an unknown name."""
        if name is None:
            return None
        adapter = self.registered.get(name)
        if adapter is None:
            raise AdapterNotFound(f"The model `{name}` does not exist.")
        return adapter

    def listing(self) -> list[tuple[str, str]]:
        return [(a.name, a.path) for a in self.registered.values()]

    def unregister(self, name: str) -> Adapter:
        """KeyError for a name that is not registered. Requests in flight keep their adapter."""
        return self.registered.pop(name)

    # ---- slots ------------------------------------------------------------------------------
    def can_acquire(self, adapter: Adapter | None) -> bool:
        return adapter is None or self._slot_of(adapter) is not None or \
            any(self._users[s] == 0 for s in range(1, self.max_loras + 1))

    def acquire(self, adapter: Adapter | None) -> int | None:
        """The slot a sequence of `adapter` runs in (0 for the base model), taking a free slot (one no
        sequence uses, least recently used first) when the adapter has none; None while every slot is in
        use by other adapters."""
        if adapter is None:
            return 0
        slot = self._slot_of(adapter)
        if slot is None:
            free = [s for s in range(1, self.max_loras + 1) if self._users[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self._slots[s] is not None, self._last_used[s]))
            self._slots[slot] = adapter
            self.pending_loads = [(s, a) for s, a in self.pending_loads if s != slot]
            self.pending_loads.append((slot, adapter))
        self._users[slot] += 1
        self._last_used[slot] = next(self._clock)
        return slot

    def active(self) -> list[str]:
        """Names of the adapters that running sequences use, sorted."""
        return sorted({a.name for s, a in enumerate(self._slots) if s and a is not None and self._users[s]})

    def release(self, slot: int) -> None:
        if slot:
            self._users[slot] -= 1
            assert self._users[slot] >= 0, f"LoRA slot {slot} released more often than taken"

    def take_loads(self) -> list[tuple[int, Adapter]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def _slot_of(self, adapter: Adapter) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if self._slots[slot] is adapter:
                return slot
        return None
