"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2 with qkv bias).

Module and attribute names follow Hugging Face's LlamaForCausalLM so checkpoints load by name;
fused projections are declared in `packed_modules_mapping` instead of converted offline.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.layers import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                    QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                    VocabParallelEmbedding, silu_and_mul)
from lockstep_engine.model_config import ModelConfig
from lockstep_engine.parallel import ParallelState


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, state: ParallelState, backend, rotary: RotaryEmbedding):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, state)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, False, state)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary = rotary
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.backend(q, k.contiguous(), v.contiguous(), self.k_cache, self.v_cache, meta)
        return self.o_proj(out.reshape(tokens, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, state: ParallelState):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], False, state)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, state: ParallelState, backend, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, state, backend, rotary)
        self.mlp = LlamaMLP(config, state)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's layout: the residual stream travels beside `hidden` (the last sublayer's output) and
        each norm adds the two, so the add runs inside the fused norm. The first layer gets residual None."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, state: ParallelState, backend, layer_range: range):
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.layer_range = layer_range
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, state) \
            if state.is_first_stage or config.tie_word_embeddings and state.is_last_stage else None
        # Layers outside this pipeline stage are absent; names keep their global index.
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config, state, backend, rotary) for i in layer_range})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if state.is_last_stage else None
        self.is_first_stage = state.is_first_stage

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers.values():
            hidden, residual = layer(positions, hidden, residual, meta)
        if self.norm is not None:
            return self.norm(hidden, residual)[0]
        # the next pipeline stage receives one tensor: the full hidden state
        return hidden + residual


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, state: ParallelState, backend):
        super().__init__()
        self.config = config
        self.state = state
        self.layer_range = stage_layers(config.num_hidden_layers, state.pp_rank, state.pp_size,
                                        head_weight_in_layers(config), os.environ.get(PARTITION_ENV))
        self.model = LlamaModel(config, state, backend, self.layer_range)
        self.lm_head = None
        if state.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, state)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta, hidden=None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers.values()]

    def load_weights(self, weights) -> int:
        """Loads full checkpoint tensors by Hugging Face name; each layer keeps its shard."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = 0
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard_id = _map_name(name, self.packed_modules_mapping)
            if target.startswith("model.layers."):
                index = int(target.split(".")[2])
                if index not in self.layer_range:
                    continue
            param = params.get(target)
            if param is None:
                if not self._belongs_to_other_stage(target):
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({target!r})")
                continue
            module = self.get_submodule(target.rsplit(".", 1)[0])
            tensor = tensor.to(device=param.device, dtype=param.dtype)
            if hasattr(module, "weight_loader"):
                module.weight_loader(param, tensor, shard_id)
            else:
                param.data.copy_(tensor)
            loaded += 1
        return loaded

    def _belongs_to_other_stage(self, target: str) -> bool:
        return self.state.pp_size > 1 and target.split(".")[0] in ("model", "lm_head")


def _map_name(name: str, mapping: dict) -> tuple[str, object]:
    for source, (target, shard_id) in mapping.items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard_id
    return name, None


PARTITION_ENV = "LOCKSTEP_PP_LAYER_PARTITION"  # e.g. "19,11": layers per stage (vLLM: VLLM_PP_LAYER_PARTITION)


def head_weight_in_layers(config: ModelConfig) -> float:
    """The LM head's weight bytes in decoder layers: what the last stage reads per step on top of its
    layers (decode reads every weight once per step, so bytes are what a stage's step time follows)."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    layer = h * q * 2 + h * kv * 2 + 3 * h * config.intermediate_size
    return config.vocab_size * h / layer


def stage_layers(num_layers: int, pp_rank: int, pp_size: int, head_layers: float = 0.0,
                 partition: str | None = None) -> range:
    """Layers of one pipeline stage. The stages get equal weight to read per step: the last one also
    runs the LM head, worth `head_layers` layers, so it takes fewer decoder layers; the others split the
    rest evenly, earlier stages taking the remainder. `partition` ("19,11") sets the counts instead."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    if partition:
        counts = _parse_partition(partition, num_layers, pp_size)
    elif pp_size == 1:
        counts = [num_layers]
    else:
        share = (num_layers + head_layers) / pp_size
        last = min(max(round(share - head_layers), 1), num_layers - (pp_size - 1))
        base, extra = divmod(num_layers - last, pp_size - 1)
        counts = [base + (1 if s < extra else 0) for s in range(pp_size - 1)] + [last]
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def _parse_partition(partition: str, num_layers: int, pp_size: int) -> list[int]:
    try:
        counts = [int(x) for x in partition.split(",")]
    except ValueError:
        counts = []
    if len(counts) != pp_size or min(counts, default=0) < 1 or sum(counts) != num_layers:
        raise ValueError(f"{PARTITION_ENV}={partition!r} is invalid: expected {pp_size} comma-separated layer "
                         f"counts, each >= 1, summing to the model's {num_layers} layers")
    return counts
