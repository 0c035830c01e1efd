"""Model-side LoRA cases shared by tests/engine/test_lora_model.py and the tensor-parallel processes it
starts (which import this module only: no transformers, no peft, no pytest)."""

from __future__ import annotations

import torch

from lockstep_engine.attention import AttentionMetadata, TorchPagedAttention
from lockstep_engine.lora.adapters import LoRAAdapter, module_shapes
from lockstep_engine.lora.model import ModelLoRA
from lockstep_engine.model_config import ModelConfig
from lockstep_engine.models.llama import LlamaForCausalLM
from lockstep_engine.parallel import ParallelState

BLOCK_SIZE = 16


def prefill_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """The last position's logits of each prompt, all prompts in one prefill forward: [prompts, vocab]."""
    weight = model.lm_head.weight
    with torch.device(weight.device):
        return _prefill_logits(model, prompts, weight.dtype)


def _prefill_logits(model: LlamaForCausalLM, prompts: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    attn = model.attention_layers()[0]
    num_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(num_blocks + 1, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim, dtype=dtype)
        layer.v_cache = torch.zeros_like(layer.k_cache)
    tables, slot_mapping, starts, block = [], [], [0], 0
    for prompt in prompts:
        count = -(-len(prompt) // BLOCK_SIZE)
        tables.append(list(range(block, block + count)))
        slot_mapping += [block * BLOCK_SIZE + i for i in range(len(prompt))]
        starts.append(starts[-1] + len(prompt))
        block += count
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor([len(p) for p in prompts]), query_start_loc=torch.tensor(starts),
        query_start_loc_host=starts, seq_lens_host=[len(p) for p in prompts])
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.inference_mode():
        hidden = model(ids, positions, meta)
        return model.compute_logits(hidden[torch.tensor(starts[1:]) - 1])


TP_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from lora_cases import tp_logits
rank, port = int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
logits = tp_logits(rank, 2, dist.group.WORLD)
if rank == 0:
    torch.save(logits, sys.argv[4])
dist.barrier()  # both ranks done before either tears the group down
dist.destroy_process_group()
# gloo's threads can still be joinable in C++ static destructors at interpreter exit ("terminate called without an
# active exception", seen under load): the result is saved, so leave without them
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""
# 8 query heads and 1 KV head: with 2 ranks the KV head (and B's k and v rows) is replicated.
TP_CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=1, head_dim=8, max_position_embeddings=128)


def tp_logits(tp_rank: int, tp_size: int, group, device: str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """Logits of a seeded random model with two random adapters and the base mixed in one batch (the
    weights drawn on the CPU, so every device and layout sees the same ones)."""
    model, lora = tp_model(tp_rank, tp_size, group, device, dtype)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32]]
    lora.set_slots(torch.tensor([slot for slot, p in zip((1, 0, 2), prompts) for _ in p]))
    return prefill_logits(model, prompts)


def tp_model(tp_rank: int, tp_size: int, group, device: str = "cpu", dtype=torch.float32):
    """TP_CONFIG's model with seeded random weights and adapters of rank 8 (slot 1) and 3 (slot 2)."""
    from lockstep_engine.sources import _weight_names

    torch.manual_seed(0)
    state = ParallelState(tp_rank=tp_rank, tp_size=tp_size, tp_group=group)
    c = TP_CONFIG
    backend = TorchPagedAttention(c.num_attention_heads // tp_size, 1, c.head_dim, BLOCK_SIZE)
    model = LlamaForCausalLM(c, state, backend)
    model.load_weights((name, torch.randn(shape) * 0.2) for name, shape in _weight_names(c))
    model.to(device, dtype)
    lora = ModelLoRA(model, max_loras=2, max_rank=8, max_tokens=64, device=device, dtype=dtype)
    for slot, rank in ((1, 8), (2, 3)):
        weights = {(layer, module): (torch.randn(rank, size_in), torch.randn(size_out, rank) * 0.1)
                   for layer in range(c.num_hidden_layers) for module, (size_in, size_out) in module_shapes(c).items()}
        lora.load(slot, LoRAAdapter(f"a{slot}", "-", rank, 2.0 / rank, weights))
    return model, lora
