"""Tensor-parallel-ready building blocks of a Llama-family decoder.

Linear and embedding layers hold their rank's shard and load it from the full checkpoint tensor
(`weight_loader`), so the model file stays pure architecture and works for any TP size.

On CUDA, RMSNorm (with the residual add), SiLU-and-mul and rotary with the KV-cache write run as
fused Triton kernels (`kernels/fused.py`) unless LOCKSTEP_FUSED_KERNELS=0 or Triton cannot be
imported; on the CPU the torch ops below always run, in Hugging Face's order, so fp32 results match
it bit for bit.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from lockstep_engine.log import log
from lockstep_engine.parallel import ParallelState, tp_all_gather_last_dim, tp_all_reduce


def _shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; each rank keeps its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool, state: ParallelState):
        super().__init__()
        if output_size % state.tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tensor_parallel_size={state.tp_size}")
        self.state = state
        self.weight = nn.Parameter(torch.empty(output_size // state.tp_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size // state.tp_size), requires_grad=False) if bias else None
        self.lora = None  # lora.model.LoRALinear when LoRA adapters are enabled

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_shard(full, 0, self.state.tp_rank, self.state.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, state: ParallelState):
        super().__init__(input_size, sum(output_sizes), bias, state)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.state.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.state.tp_size
        param.data.narrow(0, offset, size).copy_(_shard(full, 0, self.state.tp_rank, self.state.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; KV heads are split across ranks, or replicated when
    there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 state: ParallelState):
        tp = state.tp_size
        if num_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the {num_heads} attention heads")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={tp} neither divides nor is a multiple of the "
                             f"{num_kv_heads} KV heads")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(num_kv_heads // tp, 1)
        self.kv_replicas = max(tp // num_kv_heads, 1)
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp, bias, state)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        d, rank = self.head_dim, self.state.tp_rank
        if shard_id == "q":
            offset, size, index = 0, self.num_heads * d, rank
        else:
            offset = (self.num_heads + (0 if shard_id == "k" else self.num_kv_heads)) * d
            size, index = self.num_kv_heads * d, rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(full.narrow(0, index * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial results are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, state: ParallelState):
        super().__init__()
        if input_size % state.tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor_parallel_size={state.tp_size}")
        self.state = state
        self.weight = nn.Parameter(torch.empty(output_size, input_size // state.tp_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.lora = None  # lora.model.LoRALinear when LoRA adapters are enabled

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:
            param.data.copy_(full)
        else:
            param.data.copy_(_shard(full, 1, self.state.tp_rank, self.state.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora is not None:
            self.lora.add_to(x, y)  # before the all-reduce: the term is linear, so the sum over ranks is exact
        y = tp_all_reduce(y, self.state)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; rows a rank lacks contribute zeros to the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, state: ParallelState):
        super().__init__()
        self.state = state
        self.vocab_size = vocab_size
        self.shard_size = math.ceil(vocab_size / state.tp_size)
        self.vocab_start = state.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        rows = full[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return tp_all_reduce(y, self.state)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tp_all_gather_last_dim(F.linear(hidden, self.weight), self.state)
        return logits[..., :self.vocab_size]


FUSED_KERNELS_ENV = "LOCKSTEP_FUSED_KERNELS"  # "0": the torch ops on CUDA too (read once per process)


@functools.cache
def _fused_kernels():
    """lockstep_engine.kernels.fused, or None when switched off by the environment or Triton is missing."""
    if os.environ.get(FUSED_KERNELS_ENV) == "0":
        return None
    try:
        from lockstep_engine.kernels import fused
    except ImportError:
        return None
    return fused


def fused_kernels_for(x: torch.Tensor):
    """The fused kernels module for a tensor on CUDA (None on the CPU or when they are off)."""
    return _fused_kernels() if x.is_cuda else None


# "1": a decoder layer's add + RMSNorm + projection (and the MLP's SiLU-and-mul) as one kernel on CUDA,
# `kernels/norm_linear.py`. Off by default until measured against cuBLAS on a GPU (read once per process).
NORM_LINEAR_ENV = "LOCKSTEP_NORM_LINEAR"
NORM_LINEAR_MAX_TOKENS = 512  # above it (prefill chunks) the layer keeps cuBLAS's GEMMs, tuned for large ones


@functools.cache
def _norm_linear_kernels():
    if os.environ.get(NORM_LINEAR_ENV) != "1" or _fused_kernels() is None:
        return None
    from lockstep_engine.kernels import norm_linear
    log(f"{NORM_LINEAR_ENV}=1: decoder layers of at most {NORM_LINEAR_MAX_TOKENS} tokens run add + RMSNorm + "
        f"projection as one kernel on CUDA")
    return norm_linear


def norm_linear_for(x: torch.Tensor):
    """`kernels.norm_linear` for a layer input on CUDA of at most NORM_LINEAR_MAX_TOKENS tokens when switched
    on; None otherwise (the unfused layer)."""
    return _norm_linear_kernels() if x.is_cuda and x.shape[0] <= NORM_LINEAR_MAX_TOKENS else None


class RMSNorm(nn.Module):
    """norm(x), or with a residual (vLLM's fused add): h = x + residual, returning (norm(h), h)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x, residual: [tokens, hidden]
        fused = fused_kernels_for(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        h = x + residual
        return self._norm(h), h

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as Hugging Face's LlamaRMSNorm, so fp32 results match bit for bit.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Hugging Face's half-split layout) with a cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling type {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
                             f"(expected default or llama3)")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], positions: [tokens]
        fused = fused_kernels_for(q)
        if fused is not None:
            return fused.rotary(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotates q and k, writes k and v to the paged cache at `slot_mapping` (one kernel on CUDA);
        returns the rotated q. q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (views of
        the qkv projection's output); caches: [num_blocks + 1, block_size, kv_heads, head_dim]."""
        fused = fused_kernels_for(q)
        if fused is not None:
            return fused.rotary_write_kv(positions, q, k, v, self.cos, self.sin, k_cache, v_cache, slot_mapping)
        q, k = self(positions, q, k)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
        return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * I], gate then up (gate_up_proj's output) -> silu(gate) * up: [tokens, I]."""
    fused = fused_kernels_for(x)
    if fused is not None:
        return fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
