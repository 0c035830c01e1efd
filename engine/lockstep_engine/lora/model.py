"""LoRA weight slots attached to a loaded Llama-family model (this rank's shard, this stage's layers).

Every q/k/v/o/gate/up/down projection gets stacked buffers for `max_loras + 1` slots: slot 0 stays
zeros (the base model), slots 1..max_loras hold adapters. A forward reads one slot per token from
the persistent `token_slots` buffer (static, so CUDA graphs capture it); the runner fills it with
`set_slots` before each forward. The layers (`layers.py`) call `LoRALinear.add_to(x, y)` on their
local output before any all-reduce: the LoRA term is linear, so the sum over ranks is exact.

Sharding follows the base weights, by calling each layer's own `weight_loader` on the LoRA tensors:
column-parallel layers (qkv_proj, gate_up_proj) keep A whole and take their rows of B the way the
base weight takes its rows (q/k/v heads with KV-head replication, gate/up halves); row-parallel
layers (o_proj, down_proj) take their columns of A and keep B whole.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lockstep_engine.lora.adapters import LoRAAdapter
from lockstep_engine.lora.ops import add_lora_grouped, add_lora_plain, triton_available

# HF target -> (the module inside a decoder layer, its shard id: the sub-projection of a packed layer)
TARGETS = {"q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
           "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", None)}
_SUB_INDEX = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}


class LoRALinear:
    """The LoRA slots of one linear layer (held as the layer's `lora` attribute; not a module, so the
    model's parameters and state dict are unchanged)."""

    def __init__(self, owner: ModelLoRA, layer, slices: tuple[tuple[int, int], ...], row_parallel: bool):
        self.owner = owner
        self.layer = layer
        self.slices = slices  # (offset, size) of each sub-projection in the layer's local output
        self.row_parallel = row_parallel
        out_size, in_size = layer.weight.shape
        num_slots, rank = owner.max_loras + 1, owner.max_rank
        kwargs = dict(device=owner.device, dtype=owner.dtype)
        self.a = torch.zeros(num_slots, len(slices) * rank, in_size, **kwargs)
        self.b = torch.zeros(num_slots, out_size, rank, **kwargs)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA term of each token's slot. x: [tokens, in_local]; y: [tokens, out_local]."""
        owner = self.owner
        if not (owner.always_on or owner.has_adapters):
            return
        if use_kernels(x):
            add_lora_grouped(x, y, self.a, self.b, owner.groups(x.shape[0]), self.slices)
        else:
            add_lora_plain(x, y, self.a, self.b, owner.token_slots[:x.shape[0]], owner.distinct_slots(),
                           self.slices)

    def load(self, slot: int, shard_id, a: torch.Tensor, b: torch.Tensor) -> None:
        """One target's full A [r, in] and scaled B [out, r], padded to max_rank and sharded into `slot`."""
        rank = self.owner.max_rank
        a = torch.nn.functional.pad(a, (0, 0, 0, rank - a.shape[0])).to(self.a.dtype)
        b = torch.nn.functional.pad(b, (0, rank - b.shape[1])).to(self.b.dtype)
        if self.row_parallel:
            self.layer.weight_loader(SimpleNamespace(data=self.a[slot]), a.to(self.a.device))
            self.b[slot].copy_(b)
            return
        sub = _SUB_INDEX[shard_id]
        self.a[slot, sub * rank:(sub + 1) * rank].copy_(a)
        self.layer.weight_loader(SimpleNamespace(data=self.b[slot]), b.to(self.b.device), shard_id)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


class ModelLoRA:
    """LoRA slots for every targetable linear layer of `model` (a `LlamaForCausalLM`)."""

    def __init__(self, model, max_loras: int, max_rank: int, max_tokens: int, device, dtype):
        if max_loras < 1 or max_rank < 1 or max_tokens < 1:
            raise ValueError(f"max_loras={max_loras}, max_lora_rank={max_rank} and max_tokens={max_tokens} "
                             f"must be positive")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.layer_range = model.layer_range
        self.always_on = False  # set by the runner while capturing CUDA graphs: graph-safe kernels, always run
        self.has_adapters = False  # whether the slots of the current forward name any adapter
        self.active_slots: list[int] | None = []  # the distinct non-zero slots of the forward (None: not read yet)
        self.token_slots = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
        self._groups = None  # kernels.Groups of the current forward's tokens, made by its first LoRA layer
        self.layers: dict[tuple[int, str], LoRALinear] = {}  # (layer index, module path) -> slots
        self.adapters: dict[int, str] = {}  # slot -> name of the adapter loaded there
        for index in model.layer_range:
            decoder = model.model.layers[str(index)]
            for path in dict.fromkeys(module for module, _ in TARGETS.values()):
                layer = decoder.get_submodule(path)
                layer.lora = self.layers[(index, path)] = LoRALinear(self, layer, _slices(layer), _is_row(path))

    @property
    def nbytes(self) -> int:
        return self.token_slots.nbytes + sum(layer.nbytes for layer in self.layers.values())

    def set_slots(self, slots: torch.Tensor | None) -> None:
        """The next forward's slot per token ([tokens] int64; None: every token uses the base model).
        A host tensor tells which adapters the batch uses without a device sync; a device tensor is only
        copied (graph-safe), and the forward then runs the LoRA path for every token (slot 0 adds zeros)."""
        self._groups = None
        if slots is None:
            self.token_slots.zero_()
            self.has_adapters, self.active_slots = False, []
            return
        count = slots.shape[0]
        if count > self.token_slots.shape[0]:
            raise ValueError(f"{count} tokens exceed the LoRA slot buffer of {self.token_slots.shape[0]}")
        self.token_slots[count:].zero_()
        self.token_slots[:count].copy_(slots, non_blocking=True)
        if slots.device.type == "cpu":
            self.active_slots = [slot for slot in torch.unique(slots).tolist() if slot != 0]
            self.has_adapters = bool(self.active_slots)
        else:
            self.active_slots, self.has_adapters = None, True

    def groups(self, tokens: int):
        """The current forward's first `tokens` tokens grouped by slot on the device (`kernels.group`), made
        once and shared by every layer; inside a CUDA graph capture the grouping is captured with them."""
        if self._groups is None or self._groups.tokens != tokens:
            from lockstep_engine.lora import kernels

            self._groups = kernels.group(self.token_slots[:tokens], self.max_loras + 1)
        return self._groups

    def distinct_slots(self) -> list[int]:
        """The distinct non-zero slots of the current forward (read from the device once if need be)."""
        if self.active_slots is None:
            self.active_slots = [slot for slot in torch.unique(self.token_slots).tolist() if slot != 0]
        return self.active_slots

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts `adapter` into `slot` (1..max_loras), replacing what was there."""
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank="
                             f"{self.max_rank}")
        self.clear(slot)
        for (index, module), (a, b) in adapter.weights.items():
            if index not in self.layer_range:
                continue  # another pipeline stage's layer
            path, shard_id = TARGETS[module]
            self.layers[(index, path)].load(slot, shard_id, a, b * adapter.scale)
        self.adapters[slot] = adapter.name

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        for layer in self.layers.values():
            layer.clear(slot)
        self.adapters.pop(slot, None)

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range (expected 1..{self.max_loras})")


def use_kernels(x: torch.Tensor) -> bool:
    """The grouped Triton kernels on CUDA; the plain per-slot path elsewhere (tests switch it)."""
    return x.is_cuda and triton_available()


def _is_row(path: str) -> bool:
    return path.endswith(("o_proj", "down_proj"))


def _slices(layer) -> tuple[tuple[int, int], ...]:
    """(offset, size) of each sub-projection in the layer's local output rows."""
    if hasattr(layer, "num_kv_heads"):  # QKVParallelLinear
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return (0, q), (q, kv), (q + kv, kv)
    if hasattr(layer, "output_sizes"):  # MergedColumnParallelLinear
        sizes = [size // layer.state.tp_size for size in layer.output_sizes]
        return tuple((sum(sizes[:i]), size) for i, size in enumerate(sizes))
    return ((0, layer.weight.shape[0]),)
