"""Reading a PEFT LoRA adapter from disk, refusing anything the model side cannot serve.

A PEFT adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`
with A [r, in] and B [out, r]. Every check happens here, on the host, before a byte reaches a
device: the file size, the safetensors header (parsed by the `safetensors` package, which bounds
every offset by the file), the config's fields, each tensor's name, layer index and shape against
the base model. Any failure is an `AdapterError` naming the adapter, the file or field, and why.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from lockstep_engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The linear layers an adapter may target, and the block each lives in.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class AdapterError(ValueError):
    """The adapter cannot be served; the message names the adapter, the file or field, and the reason."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    # (layer index, "q_proj"...) -> (A [r, in], B [out, r]): full, unsharded, float32, on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each targetable linear layer of the base model (full, unsharded)."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_adapter(name: str, path: str, model_config: ModelConfig, max_rank: int,
                 max_bytes: int = 2 << 30) -> LoRAAdapter:
    """Reads and checks the PEFT adapter in directory `path` for a model of `model_config`."""
    fail = _failer(name, path)
    if not os.path.isdir(path):
        raise fail("path", "is not a directory")
    config = _read_config(os.path.join(path, CONFIG_FILE), fail)
    rank, scale, targets = _check_config(config, max_rank, fail)
    weights = _read_weights(os.path.join(path, WEIGHTS_FILE), max_bytes, fail)
    pairs = _check_tensors(weights, rank, targets, model_config, fail)
    return LoRAAdapter(name=name, path=path, rank=rank, scale=scale, weights=pairs)


def _failer(name: str, path: str):
    def fail(where: str, reason: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {where}: {reason}")

    return fail


def _read_config(config_path: str, fail) -> dict:
    if not os.path.isfile(config_path):
        raise fail(CONFIG_FILE, "missing (expected a PEFT adapter directory)")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise fail(CONFIG_FILE, f"unreadable JSON ({error})") from None
    if not isinstance(config, dict):
        raise fail(CONFIG_FILE, "expected a JSON object")
    return config


def _check_config(config: dict, max_rank: int, fail) -> tuple[int, float, set[str] | None]:
    """(rank, scale, the targets named by a list, or None when target_modules is a pattern)."""
    field = f"{CONFIG_FILE} field"
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"{field} peft_type", f"{peft_type!r} is not supported (expected LORA)")
    if config.get("use_dora"):
        raise fail(f"{field} use_dora", "DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"{field} bias", f"{config['bias']!r} is not supported (expected 'none')")
    # per-module ranks, extra trained modules, LoRA biases, replicated layers: none has a slot to go to
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias", "layer_replication",
                "target_parameters"):
        if config.get(key):
            raise fail(f"{field} {key}", f"{config[key]!r} is not supported (expected it unset or empty)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail(f"{field} r", f"{rank!r} is invalid (expected a positive integer)")
    if rank > max_rank:
        raise fail(f"{field} r", f"rank {rank} exceeds max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise fail(f"{field} lora_alpha", f"{alpha!r} is invalid (expected a number)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale), _check_targets(config.get("target_modules"), fail)


def _check_targets(targets, fail) -> set[str] | None:
    field = f"{CONFIG_FILE} field target_modules"
    if isinstance(targets, str):
        # PEFT reads a single string as a pattern over module names; the tensors then say what it matched.
        if targets in TARGET_MODULES:
            return {targets}
        return None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise fail(field, f"{targets!r} is invalid (expected a list of module names or a single string)")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise fail(field, f"unsupported target {', '.join(map(repr, unknown))} "
                          f"(expected some of {', '.join(TARGET_MODULES)})")
    return set(targets)


def _read_weights(weights_path: str, max_bytes: int, fail) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(weights_path):
        other = " (adapter_model.bin is not read: save the adapter with safetensors)" \
            if os.path.isfile(os.path.join(os.path.dirname(weights_path), "adapter_model.bin")) else ""
        raise fail(WEIGHTS_FILE, f"missing{other}")
    size = os.path.getsize(weights_path)
    if size > max_bytes:
        raise fail(WEIGHTS_FILE, f"{size} bytes exceeds the bound of {max_bytes} bytes")
    try:
        with safe_open(weights_path, framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise fail(WEIGHTS_FILE, f"not a valid safetensors file ({error})") from None


def _check_tensors(weights: dict[str, torch.Tensor], rank: int, targets: set[str] | None, config: ModelConfig,
                   fail) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _TENSOR_NAME.fullmatch(key)
        if match is None or TARGET_MODULES.get(match.group(3)) != match.group(2):
            raise fail(f"{WEIGHTS_FILE} tensor {key!r}", "unsupported (only LoRA A/B weights of "
                       f"{', '.join(TARGET_MODULES)} in the decoder layers are served)")
        layer, module, half = int(match.group(1)), match.group(3), match.group(4)
        where = f"{WEIGHTS_FILE} tensor {key!r}"
        if targets is not None and module not in targets:
            raise fail(where, f"{module} is not in target_modules")
        if layer >= config.num_hidden_layers:
            raise fail(where, f"layer {layer} is out of range (the model has {config.num_hidden_layers} layers)")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise fail(where, f"dtype {tensor.dtype} is not supported (expected float32, float16 or bfloat16)")
        size_in, size_out = shapes[module]
        expected = (rank, size_in) if half == "A" else (size_out, rank)
        if tuple(tensor.shape) != expected:
            raise fail(where, f"shape {list(tensor.shape)} does not match the base model (expected {list(expected)} "
                              f"for rank {rank})")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    if not halves:
        raise fail(WEIGHTS_FILE, "holds no LoRA tensors")
    pairs = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise fail(WEIGHTS_FILE, f"layer {layer} {module} has no {missing} weight")
        pairs[(layer, module)] = (pair["A"].contiguous(), pair["B"].contiguous())
    return pairs
