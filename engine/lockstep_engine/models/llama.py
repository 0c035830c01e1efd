"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2 with qkv bias).

Module and attribute names follow Hugging Face's LlamaForCausalLM so checkpoints load by name;
fused projections are declared in `packed_modules_mapping` instead of converted offline.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                                    RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding, norm_linear_for,
                                    silu_and_mul)
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
        return self.attend(positions, self.qkv_proj(hidden), meta)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything after the qkv projection: rotary, the cache write, attention, o_proj."""
        tokens = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        # rotary and the cache write in one kernel on CUDA; attention then reads k and v from the cache
        q = self.rotary.rotate_and_cache(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.attend(q, self.k_cache, self.v_cache, meta)
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
        fused = norm_linear_for(hidden)  # None on the CPU and unless switched on: the check below is skipped
        if fused is not None and self._fusable():  # each norm inside the projection after it; SiLU-and-mul in gate_up's
            attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
            qkv, residual = fused.norm_linear(hidden, residual, norm1.weight, norm1.eps, attn.qkv_proj.weight)
            hidden = attn.attend(positions, qkv, meta)
            gated, residual = fused.norm_linear(hidden, residual, norm2.weight, norm2.eps, mlp.gate_up_proj.weight,
                                                silu_mul=True)
            return mlp.down_proj(gated), residual
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _fusable(self) -> bool:
        """Whether the fused norm + projection kernels can stand in: no qkv bias, no LoRA on the projections."""
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        return qkv.bias is None and qkv.lora is None and gate_up.lora is None


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

    def __init__(self, config: ModelConfig, state: ParallelState, backend, layer_range: range | None = None):
        """`layer_range`: this pipeline stage's decoder layers (`parallel.stage_layers`); None: all."""
        super().__init__()
        self.config = config
        self.state = state
        self.layer_range = range(config.num_hidden_layers) if layer_range is None else layer_range
        self.model = LlamaModel(config, state, backend, self.layer_range)
        self.lm_head = None
        if state.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, state)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    lora = None  # the runner's `lora.model.ModelLoRA` when LoRA adapters are on

    def forward(self, input_ids, positions, meta, hidden=None) -> torch.Tensor:
        if self.lora is not None:
            self.lora.set_slots(meta.lora_slots)
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
