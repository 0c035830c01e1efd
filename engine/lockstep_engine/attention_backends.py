"""Which paged-attention backend runs (`--attention-backend {auto,triton,flash-attn,torch}`, vLLM's
VLLM_ATTENTION_BACKEND choice).

* torch: `attention.TorchPagedAttention` (SDPA over the gathered cache), any device; the reference.
* triton: `kernels/triton_attention.py`, CUDA only.
* flash-attn: `kernels/flash_attention.py`, FlashAttention-4 from the optional `flash-attn` extra, CUDA only.
* auto: torch on the CPU. On CUDA, per phase (decode steps; prefill and mixed steps), the backend
  `AUTO_BY_PHASE` names for that phase on a Hopper GPU (the fastest measured there), Triton on other
  GPUs; a backend that cannot load (flash-attn not installed) falls back to Triton, and Triton to torch.

All backends share the cache layout [num_blocks + 1, block_size, kv_heads, head_dim], so one model can
switch between them (`ModelRunner.use_attention_backend`) and `auto` can mix them by phase.
"""

from __future__ import annotations

import torch

from lockstep_engine.attention import AttentionMetadata, PagedAttention, TorchPagedAttention
from lockstep_engine.config import ATTENTION_BACKENDS
# auto's choice per phase on compute capability 9.x, from benchmarks/attention_backends.py on an H200
# (2026-12-03, docs/BENCHMARKS.md): Triton decodes faster at every batch (Llama-3-8B 1.24-1.39x of its byte
# bound against flash-attn-4's 1.53-1.76x); flash-attn-4 prefills 1.8x faster at 2048 and 8192 tokens (and
# level on a mixed step).
AUTO_BY_PHASE = {"decode": "triton", "prefill": "flash-attn"}
AUTO_CAPABILITY = 9


class PhaseAttention(PagedAttention):
    """Decode steps through one backend, prefill and mixed steps through another."""

    def __init__(self, decode, prefill):
        self.decode, self.prefill = decode, prefill
        self.name = f"{decode.name}+{prefill.name}"
        self.graph_safe = getattr(decode, "graph_safe", False)  # decode graphs hold decode steps only
        self.prefill_graph_safe = getattr(prefill, "prefill_graph_safe", False)
        self.write_kv = decode.write_kv

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        return (self.decode if meta.is_decode else self.prefill).attend(q, k_cache, v_cache, meta)


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device):
    """The attention backend `name` asks for on `device` (see the module docstring for auto)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    shape = (num_heads, num_kv_heads, head_dim, block_size)
    if device.type != "cuda":
        if name in ("triton", "flash-attn"):
            raise ValueError(f"attention_backend={name!r} needs device='cuda' (expected torch or auto on the CPU)")
        return TorchPagedAttention(*shape)
    if name != "auto":
        return _build(name, shape)
    choice = AUTO_BY_PHASE if torch.cuda.get_device_capability(device)[0] == AUTO_CAPABILITY else {}
    built: dict[str, object] = {}
    for phase in ("decode", "prefill"):
        wanted = choice.get(phase, "triton")
        if wanted not in built:
            built[wanted] = _build_or_fallback(wanted, shape)
    decode, prefill = built[choice.get("decode", "triton")], built[choice.get("prefill", "triton")]
    return decode if decode.name == prefill.name else PhaseAttention(decode, prefill)


def _build(name: str, shape: tuple):
    if name == "torch":
        return TorchPagedAttention(*shape)
    try:
        if name == "triton":
            from lockstep_engine.kernels.triton_attention import TritonPagedAttention

            return TritonPagedAttention(*shape)
        from lockstep_engine.kernels.flash_attention import FlashAttnPagedAttention

        return FlashAttnPagedAttention(*shape)
    except (ImportError, ValueError) as error:
        raise ValueError(f"attention_backend={name!r} is unavailable: {error}") from error


def _build_or_fallback(name: str, shape: tuple):
    """auto's backend for a phase: `name`, else Triton, else torch."""
    for candidate in dict.fromkeys((name, "triton")):
        try:
            return _build(candidate, shape)
        except ValueError:
            continue
    return TorchPagedAttention(*shape)
