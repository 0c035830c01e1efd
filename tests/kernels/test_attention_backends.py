"""--attention-backend: which backend each name gives, auto's per-phase choice and fallbacks (CPU), and
the FlashAttention-4 backend against the torch reference, in CUDA graphs and in the engine (GPU with the
optional flash-attn extra installed)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from lockstep_engine import attention_backends
from lockstep_engine.attention import AttentionMetadata, TorchPagedAttention
from lockstep_engine.attention_backends import PhaseAttention, make_backend
from lockstep_engine.kernels.flash_attention import FlashAttnPagedAttention

CUDA = torch.cuda.is_available()
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
needs_flash_attn = pytest.mark.skipif(not (CUDA and HAS_FLASH_ATTN),
                                      reason="needs CUDA and the flash-attn extra (flash-attn-4)")
SHAPE = (8, 2, 64, 16)  # heads, kv heads, head_dim, block size


# ---------------------------------------------------------------------------------------------
# Choosing a backend (CPU)
# ---------------------------------------------------------------------------------------------

def test_the_cpu_runs_torch_and_refuses_the_gpu_backends():
    cpu = torch.device("cpu")
    assert isinstance(make_backend("auto", *SHAPE, cpu), TorchPagedAttention)
    assert isinstance(make_backend("torch", *SHAPE, cpu), TorchPagedAttention)
    for name in ("triton", "flash-attn"):
        with pytest.raises(ValueError, match=f"attention_backend='{name}' needs device='cuda'"):
            make_backend(name, *SHAPE, cpu)
    with pytest.raises(ValueError, match="not one of auto, triton, flash-attn, torch"):
        make_backend("flashinfer", *SHAPE, cpu)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="checks the message without the extra installed")
def test_flash_attn_without_the_extra_is_an_error_naming_it():
    with pytest.raises(ImportError, match=r"pip install 'lockstep\[flash-attn\]'"):
        FlashAttnPagedAttention(*SHAPE)
    with pytest.raises(ValueError, match=r"attention_backend='flash-attn' is unavailable: .*lockstep\[flash-attn\]"):
        attention_backends._build("flash-attn", SHAPE)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="checks the fallback without the extra installed")
def test_auto_falls_back_to_triton_for_a_phase_whose_backend_cannot_load(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(attention_backends, "AUTO_BY_PHASE", {"decode": "triton", "prefill": "flash-attn"})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend = make_backend("auto", *SHAPE, torch.device("cuda"))
    assert backend.name == "triton"  # one backend for both phases, not a PhaseAttention of two


def test_auto_uses_triton_off_the_measured_capability(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(attention_backends, "AUTO_BY_PHASE", {"decode": "torch", "prefill": "torch"})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert make_backend("auto", *SHAPE, torch.device("cuda")).name == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert make_backend("auto", *SHAPE, torch.device("cuda")).name == "torch"


class _Recorder:
    def __init__(self, name):
        self.name, self.calls = name, []
        self.graph_safe = name == "decode"
        self.write_kv = TorchPagedAttention.write_kv

    def attend(self, q, k_cache, v_cache, meta):
        self.calls.append(meta.is_decode)
        return q


def test_phase_attention_sends_each_phase_to_its_backend():
    decode, prefill = _Recorder("decode"), _Recorder("prefill")
    both = PhaseAttention(decode, prefill)
    assert both.name == "decode+prefill" and both.graph_safe
    q = torch.zeros(2, 8, 64)
    cache = torch.zeros(3, 16, 2, 64)
    table = torch.zeros(2, 1, dtype=torch.int64)
    lens = torch.tensor([1, 1])
    decode_meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1]), block_tables=table, seq_lens=lens,
                                    query_start_loc=None)
    prefill_meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1]), block_tables=table[:1], seq_lens=lens[:1] * 2,
                                     query_start_loc=torch.tensor([0, 2]), query_start_loc_host=[0, 2])
    both.attend(q, cache, cache, decode_meta)
    both(q, torch.ones(2, 2, 64), torch.ones(2, 2, 64), cache, cache, prefill_meta)
    assert decode.calls == [True] and prefill.calls == [False]
    assert bool((cache[0, :2] == 1).all()), "__call__ writes this step's k and v first"


def test_int32_views_are_made_once_per_step():
    meta = AttentionMetadata(slot_mapping=torch.tensor([0]), block_tables=torch.tensor([[3, 4]]),
                             seq_lens=torch.tensor([20]), query_start_loc=None)
    table = meta.int32("block_tables")
    assert table.dtype == torch.int32 and table.tolist() == [[3, 4]]
    assert meta.int32("block_tables") is table


# ---------------------------------------------------------------------------------------------
# FlashAttention-4 on the GPU
# ---------------------------------------------------------------------------------------------

MODEL_SHAPES = [(32, 8, 128), (9, 3, 64)]  # Llama-3-8B, SmolLM2-135M


def _compare(rows, heads, kv_heads, head_dim, decode, dtype=torch.bfloat16, seed=0):
    from test_triton_attention import Batch, assert_close

    batch = Batch(rows, heads, kv_heads, head_dim, 16, dtype, seed=seed, decode=decode)
    q, k, v, kc, vc = batch.tensors()
    out = FlashAttnPagedAttention(heads, kv_heads, head_dim, 16)(q, k, v, kc, vc, batch.meta())
    rq, rk, rv, rkc, rvc = batch.tensors(device=torch.device("cpu"), dtype=torch.float32)
    expected = TorchPagedAttention(heads, kv_heads, head_dim, 16)(rq, rk, rv, rkc, rvc,
                                                                  batch.meta(device=torch.device("cpu")))
    assert_close(out, expected, dtype)


@needs_flash_attn
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
@pytest.mark.parametrize("num_seqs,max_context", [(1, 3000), (64, 700), (256, 300)])
def test_flash_attn_decode_gpu(heads, kv_heads, head_dim, num_seqs, max_context):
    rng = random.Random(num_seqs + head_dim)
    rows = [(rng.randint(0, max_context), 1) for _ in range(num_seqs)]
    _compare(rows, heads, kv_heads, head_dim, decode=True, seed=num_seqs)


@needs_flash_attn
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
def test_flash_attn_prefill_and_mixed_gpu(heads, kv_heads, head_dim):
    rng = random.Random(head_dim)
    rows = [(rng.randint(0, 900), rng.choice([1, rng.randint(1, 600)])) for _ in range(12)] + [(0, 1000), (1234, 1)]
    _compare(rows, heads, kv_heads, head_dim, decode=False, seed=7)


@needs_flash_attn
def test_flash_attn_decode_replays_in_a_cuda_graph_at_new_lengths():
    from test_triton_attention import Batch, replay_at_new_lengths

    heads, kv_heads, head_dim, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    rng = random.Random(8)
    rows = [(rng.randint(100, 900), 1) for _ in range(8)]
    batch = Batch(rows, heads, kv_heads, head_dim, bs, dtype, seed=8, decode=True)
    backend = FlashAttnPagedAttention(heads, kv_heads, head_dim, bs)
    q, k, v, kc, vc = batch.tensors()
    meta = batch.meta()
    backend(q, k, v, kc, vc, meta)  # compile outside the capture
    torch.cuda.synchronize()
    # a fresh metadata object over the same tensors: its int32 copies are made inside the capture, so
    # each replay converts the lengths written since
    captured_meta = AttentionMetadata(slot_mapping=meta.slot_mapping, block_tables=meta.block_tables,
                                      seq_lens=meta.seq_lens, query_start_loc=None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend(q, k, v, kc, vc, captured_meta)
    replay_at_new_lengths(batch, (q, k, v, kc, vc), meta, graph, out, heads, rng)


@needs_flash_attn
def test_engine_greedy_tokens_with_flash_attn_match_triton():
    """random:smollm2-135m in bf16, decode graphs captured with each backend: the same greedy tokens but for
    rare bf16 near-ties (the kernels sum in different orders)."""
    from lockstep_engine.llm import LLM
    from lockstep_engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": [(37 * i + 11 * k) % 4000 + 5 for k in range(20 + 30 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = LLM("random:smollm2-135m", dtype="bfloat16", num_scheduler_steps=8, max_num_seqs=8,
               num_gpu_blocks_override=512, attention_backend="triton")
    triton_tokens = [out.outputs[0].token_ids for out in base.generate(prompts, params)]
    flash = LLM("random:smollm2-135m", share_model_with=base, attention_backend="flash-attn", max_num_seqs=8,
                num_scheduler_steps=8)
    runner = base.engine.executor.runner
    assert runner.backend.name == "flash-attn" and runner.graphs is not None
    flash_tokens = [out.outputs[0].token_ids for out in flash.generate(prompts, params)]
    same = sum(a == b for a, b in zip(triton_tokens, flash_tokens))
    assert same >= len(prompts) - 1, (triton_tokens, flash_tokens)
    assert all(a[:4] == b[:4] for a, b in zip(triton_tokens, flash_tokens)), (triton_tokens, flash_tokens)
