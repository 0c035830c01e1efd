"""Fused RMSNorm, SiLU-and-mul, rotary (alone and with the KV-cache write) and greedy-sampling kernels
against the torch code in layers.py, attention.py and sampler.py on random inputs.

The reference always runs the torch ops on the CPU (layers.py keeps them there). On a machine
without CUDA the kernels run in Triton's interpreter (tests/kernels/conftest.py sets
TRITON_INTERPRET=1) at small sizes; Llama-3-8B sizes and CUDA-graph capture are GPU-only.
The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so under it
bf16 results are compared with a tolerance only; on the GPU the pure add and the rotary products,
rounded exactly where torch rounds, must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from lockstep_engine.kernels import fused  # noqa: E402
from lockstep_engine.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from lockstep_engine.layers import silu_and_mul as torch_silu_and_mul  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
CPU = torch.device("cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="GPU-only size (CPU runs use Triton's interpreter at small sizes)")

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def assert_close(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.cpu().float(), expected.cpu().float(), atol=atol, rtol=rtol)


def rounds_like_torch(dtype) -> bool:
    """Whether a single rounded op must match torch exactly (not bf16 under the interpreter)."""
    return dtype == torch.float32 or CUDA


def reference_norm(hidden, eps, weight) -> RMSNorm:
    norm = RMSNorm(hidden, eps).to(dtype=weight.dtype)
    norm.weight.data.copy_(weight.cpu())
    return norm


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (5, 576), (3, 1000)])  # SmolLM2's 576, a ragged 1000
def test_rms_norm(tokens, hidden, dtype):
    x, weight = randn(tokens, hidden, dtype=dtype, seed=1), randn(hidden, dtype=dtype, seed=2)
    out = fused.rms_norm(x, weight, 1e-5)
    assert_close(out, reference_norm(hidden, 1e-5, weight)(x.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_the_sum(dtype):
    x, residual = randn(6, 576, dtype=dtype, seed=3), randn(6, 576, dtype=dtype, seed=4, scale=4.0)
    weight = randn(576, dtype=dtype, seed=5)
    x_before, residual_before = x.clone(), residual.clone()
    out, h = fused.rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_h = reference_norm(576, 1e-6, weight)(x.cpu(), residual.cpu())
    if rounds_like_torch(dtype):
        assert torch.equal(h.cpu(), expected_h)
    assert_close(h, expected_h)
    assert_close(out, expected_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be written"


def test_rms_norm_strided_rows():
    """Rows of a wider buffer (a row stride larger than hidden), with and without a residual."""
    buffer = randn(4, 800, dtype=torch.float32, seed=6)
    x, residual = buffer[:, :576], buffer[:, 100:676]
    weight = randn(576, dtype=torch.float32, seed=7)
    out, h = fused.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_h = reference_norm(576, 1e-5, weight)(x.cpu(), residual.cpu())
    assert torch.equal(h.cpu(), expected_h)
    assert_close(out, expected_out)
    assert_close(fused.rms_norm(x, weight, 1e-5), reference_norm(576, 1e-5, weight)(x.cpu()))


def test_rms_norm_zero_tokens():
    x, weight = randn(0, 576, dtype=torch.float32, seed=8), randn(576, dtype=torch.float32, seed=9)
    assert fused.rms_norm(x, weight, 1e-5).shape == (0, 576)
    out, h = fused.rms_norm(x, weight, 1e-5, x.clone())
    assert out.shape == h.shape == (0, 576)


# ---------------------------------------------------------------------------------------------
# SiLU and mul
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 64), (7, 1536), (3, 1100)])  # SmolLM2's 1536; > 1024, ragged
def test_silu_and_mul(tokens, intermediate, dtype):
    x = randn(tokens, 2 * intermediate, dtype=dtype, seed=10, scale=3.0)
    out = fused.silu_and_mul(x)
    assert_close(out, torch_silu_and_mul(x.cpu()))


def test_silu_and_mul_strided_rows_and_zero_tokens():
    buffer = randn(5, 300, dtype=torch.float32, seed=11)
    x = buffer[:, :200]
    assert_close(fused.silu_and_mul(x), torch_silu_and_mul(x.cpu()))
    assert fused.silu_and_mul(buffer[:0, :200]).shape == (0, 100)


# ---------------------------------------------------------------------------------------------
# Rotary
# ---------------------------------------------------------------------------------------------

def qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed):
    """q and k as the attention layer has them: views into one [tokens, (heads + 2 kv_heads) * head_dim] buffer."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


def check_rotary(tokens, heads, kv_heads, head_dim, dtype, max_position=4096, scaling=None, seed=12):
    rotary = RotaryEmbedding(head_dim, max_position, 500000.0, scaling)
    q, k = qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_position, (tokens,), generator=gen).to(DEVICE)
    q_before, k_before = q.clone(), k.clone()
    out_q, out_k = fused.rotary(positions, q, k, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE))
    expected_q, expected_k = rotary(positions.cpu(), q.cpu(), k.cpu())
    if rounds_like_torch(dtype):
        assert torch.equal(out_q.cpu(), expected_q) and torch.equal(out_k.cpu(), expected_k)
    assert_close(out_q, expected_q)
    assert_close(out_k, expected_k)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs must not be written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 32)])  # SmolLM2, MHA, GQA 3
def test_rotary(heads, kv_heads, head_dim, dtype):
    check_rotary(5, heads, kv_heads, head_dim, dtype)


def test_rotary_llama3_scaling_and_zero_tokens():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    check_rotary(3, 4, 2, 32, torch.float32, max_position=16384, scaling=scaling)
    q, k = qkv_views(0, 4, 2, 32, torch.float32, seed=13)
    table = torch.zeros(8, 32, device=DEVICE)
    out_q, out_k = fused.rotary(torch.zeros(0, dtype=torch.int64, device=DEVICE), q, k, table, table)
    assert out_q.shape == (0, 4, 32) and out_k.shape == (0, 2, 32)


# ---------------------------------------------------------------------------------------------
# Rotary with the KV-cache write
# ---------------------------------------------------------------------------------------------

def check_rotary_write_kv(tokens, heads, kv_heads, head_dim, dtype, block_size=16, num_blocks=6, seed=40):
    """The kernel's q and cache against layers.RotaryEmbedding then attention's index_copy write; unused
    slots keep their (poisoned) contents."""
    from lockstep_engine.attention import TorchPagedAttention

    rotary = RotaryEmbedding(head_dim, 4096, 500000.0, None)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = (part.view(tokens, -1, head_dim) for part in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    # distinct slots in random blocks, the last token to the sink block (slot -1's stand-in)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[-1:] = num_blocks * block_size
    cache_shape = (num_blocks + 1, block_size, kv_heads, head_dim)
    k_cache, v_cache = randn(*cache_shape, dtype=dtype, seed=seed + 1), randn(*cache_shape, dtype=dtype, seed=seed + 2)
    expected_k_cache, expected_v_cache = k_cache.cpu().clone(), v_cache.cpu().clone()
    expected_q, expected_k = rotary(positions, q.cpu(), k.cpu())
    TorchPagedAttention.write_kv(expected_k, v.cpu().contiguous(), expected_k_cache, expected_v_cache, slots)
    qkv_before = qkv.clone()

    out_q = fused.rotary_write_kv(positions.to(DEVICE), q, k, v, rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
                                  k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(v_cache.cpu(), expected_v_cache), "v is copied bit for bit, other slots untouched"
    if rounds_like_torch(dtype):
        assert torch.equal(out_q.cpu(), expected_q) and torch.equal(k_cache.cpu(), expected_k_cache)
    assert_close(out_q, expected_q)
    assert_close(k_cache, expected_k_cache)
    assert out_q.is_contiguous()
    assert torch.equal(qkv, qkv_before), "the projection's output must not be written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 32)])
def test_rotary_write_kv(heads, kv_heads, head_dim, dtype):
    check_rotary_write_kv(5, heads, kv_heads, head_dim, dtype)


def test_rotary_write_kv_zero_tokens_writes_nothing():
    cache = torch.ones(2, 16, 2, 32, device=DEVICE)
    empty = torch.zeros(0, 4, 32, device=DEVICE)
    table = torch.zeros(8, 32, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out_q = fused.rotary_write_kv(none, empty, empty[:, :2], empty[:, :2], table, table, cache, cache, none)
    assert out_q.shape == (0, 4, 32) and bool((cache == 1).all())


# ---------------------------------------------------------------------------------------------
# Greedy sampling
# ---------------------------------------------------------------------------------------------

def reference_greedy(logits, stop_ids, min_tokens, num_generated):
    """sampler.Sampler's greedy path on float32 logits."""
    from lockstep_engine.sampler import Sampler, SamplingTensors

    rows = logits.shape[0]
    t = SamplingTensors(temperature=torch.zeros(rows), top_k=torch.zeros(rows, dtype=torch.int64),
                        top_p=torch.ones(rows), min_p=torch.zeros(rows), seeds=torch.zeros(rows, dtype=torch.int64),
                        stop_ids=stop_ids, min_tokens=min_tokens, presence=None, frequency=None, repetition=None,
                        prompt_mask=None, logit_bias=None, all_greedy=True, any_filter=False, num_logprobs=-1)
    return Sampler()(logits.float(), t, num_generated, None).tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1000, 7])  # SmolLM2's vocabulary, ragged, smaller than a block
def test_greedy_sample_matches_the_sampler(vocab, dtype):
    rows = 6
    gen = torch.Generator().manual_seed(vocab)
    logits = randn(rows, vocab, dtype=dtype, seed=vocab, scale=3.0)
    top = logits.float().cpu().argmax(dim=-1)
    # rows 0-2 stop at their own argmax and are below min_tokens (banned); rows 3-5 are past it
    stop_ids = torch.full((rows, 3), -1, dtype=torch.int64)
    stop_ids[:, 0] = top
    stop_ids[:, 1] = torch.randint(0, vocab, (rows,), generator=gen)
    min_tokens = torch.tensor([4, 4, 4, 0, 2, 1])
    num_generated = torch.tensor([0, 1, 3, 0, 2, 5])
    expected = reference_greedy(logits.cpu(), stop_ids, min_tokens, num_generated)
    assert bool((expected[:3] != top[:3]).all()) and torch.equal(expected[3:], top[3:])
    got = fused.greedy_sample(logits, stop_ids.to(DEVICE), min_tokens.to(DEVICE), num_generated.to(DEVICE))
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), expected)


def test_the_sampler_runs_the_fused_kernel_for_plain_greedy_rows_only():
    """Greedy rows with only min_tokens' ban go to the kernel (same tokens as the torch path); logprobs or
    a logit bias keep the torch ops."""
    from dataclasses import replace

    from lockstep_engine.sampler import Sampler, SamplingTensors

    rows, vocab = 3, 500
    logits = randn(rows, vocab, dtype=torch.float32, seed=60)
    calls = []
    sampler = Sampler(lambda x: calls.append(x) or fused)
    t = SamplingTensors(temperature=torch.zeros(rows), top_k=torch.full((rows,), vocab), top_p=torch.ones(rows),
                        min_p=torch.zeros(rows), seeds=torch.zeros(rows, dtype=torch.int64),
                        stop_ids=torch.tensor([[7, -1]] * rows), min_tokens=torch.tensor([2, 0, 0]), presence=None,
                        frequency=None, repetition=None, prompt_mask=None, logit_bias=None, all_greedy=True,
                        any_filter=False, num_logprobs=-1)
    t = replace(t, **{name: getattr(t, name).to(DEVICE) for name in ("temperature", "top_k", "top_p", "min_p",
                                                                      "seeds", "stop_ids", "min_tokens")})
    generated = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    tokens = sampler(logits, t, generated, None).tokens
    assert len(calls) == 1
    assert torch.equal(tokens.cpu(), Sampler()(logits, t, generated, None).tokens.cpu())
    with_logprobs = sampler(logits, replace(t, num_logprobs=0), generated, None)
    bias = torch.zeros(rows, vocab, device=DEVICE)
    sampler(logits, replace(t, logit_bias=bias), generated, None)
    assert len(calls) == 1 and torch.equal(with_logprobs.tokens, tokens) and with_logprobs.logprobs is not None


def test_greedy_sample_ties_take_the_first_index_and_no_stop_ids():
    logits = torch.zeros(2, 9000, device=DEVICE)
    logits[0, [17, 5000, 8999]] = 2.0  # the same maximum in three blocks
    logits[1, [8998, 8999]] = 1.0
    none = torch.zeros(2, 0, dtype=torch.int64, device=DEVICE)
    counts = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    assert fused.greedy_sample(logits, none, counts, counts).tolist() == [17, 8998]


# ---------------------------------------------------------------------------------------------
# GPU only: Llama-3-8B shapes (whole and split for TP 2), CUDA graphs
# ---------------------------------------------------------------------------------------------

LLAMA_TOKENS = [1, 4, 257, 4096]


@gpu_only
@pytest.mark.parametrize("tokens", LLAMA_TOKENS)
def test_llama_rms_norm_gpu(tokens):
    x, residual = randn(tokens, 4096, dtype=torch.bfloat16, seed=20), randn(tokens, 4096, dtype=torch.bfloat16, seed=21)
    weight = randn(4096, dtype=torch.bfloat16, seed=22)
    out, h = fused.rms_norm(x, weight, 1e-5, residual)
    expected_out, expected_h = reference_norm(4096, 1e-5, weight)(x.cpu(), residual.cpu())
    assert torch.equal(h.cpu(), expected_h)
    assert_close(out, expected_out)


@gpu_only
@pytest.mark.parametrize("tokens", LLAMA_TOKENS)
@pytest.mark.parametrize("intermediate", [14336, 7168])
def test_llama_silu_and_mul_gpu(tokens, intermediate):
    x = randn(tokens, 2 * intermediate, dtype=torch.bfloat16, seed=23, scale=3.0)
    assert_close(fused.silu_and_mul(x), torch_silu_and_mul(x.cpu()))


@gpu_only
@pytest.mark.parametrize("tokens", LLAMA_TOKENS)
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 4)])
def test_llama_rotary_gpu(tokens, heads, kv_heads):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    check_rotary(tokens, heads, kv_heads, 128, torch.bfloat16, max_position=8192, scaling=scaling)


@gpu_only
@pytest.mark.parametrize("tokens", LLAMA_TOKENS)
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 4)])
def test_llama_rotary_write_kv_gpu(tokens, heads, kv_heads):
    check_rotary_write_kv(tokens, heads, kv_heads, 128, torch.bfloat16, num_blocks=tokens // 16 + 2)


@gpu_only
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_llama_greedy_sample_gpu(rows):
    vocab = 128256
    logits = randn(rows, vocab, dtype=torch.bfloat16, seed=rows, scale=3.0)
    stop_ids = torch.tensor([[128001, 128009]] * rows)
    stop_ids[:, 0] = logits.float().cpu().argmax(dim=-1)
    min_tokens, num_generated = torch.full((rows,), 2), torch.arange(rows) % 4
    expected = reference_greedy(logits.cpu(), stop_ids, min_tokens, num_generated)
    got = fused.greedy_sample(logits, stop_ids.to(DEVICE), min_tokens.to(DEVICE), num_generated.to(DEVICE))
    assert torch.equal(got.cpu(), expected)


@gpu_only
def test_cuda_graph_replays_on_new_inputs():
    """All three kernels captured once, replayed on inputs copied into the captured buffers."""
    tokens, hidden, heads, kv_heads, head_dim, intermediate = 8, 4096, 32, 8, 128, 14336
    dtype = torch.bfloat16
    rotary = RotaryEmbedding(head_dim, 8192, 500000.0, None).to(DEVICE)
    weight = randn(hidden, dtype=dtype, seed=30)
    x = torch.zeros(tokens, hidden, dtype=dtype, device=DEVICE)
    residual = torch.zeros_like(x)
    gate_up = torch.zeros(tokens, 2 * intermediate, dtype=dtype, device=DEVICE)
    q, k = qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=31)
    positions = torch.zeros(tokens, dtype=torch.int64, device=DEVICE)

    def step():
        return (*fused.rms_norm(x, weight, 1e-5, residual), fused.silu_and_mul(gate_up),
                *fused.rotary(positions, q, k, rotary.cos, rotary.sin))

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in (32, 33):
        x.copy_(randn(tokens, hidden, dtype=dtype, seed=seed))
        residual.copy_(randn(tokens, hidden, dtype=dtype, seed=seed + 10))
        gate_up.copy_(randn(tokens, 2 * intermediate, dtype=dtype, seed=seed + 20))
        new_q, new_k = qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=seed + 30)
        q.copy_(new_q)
        k.copy_(new_k)
        positions.copy_(torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outputs, step()):
            assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------
# The model with the kernels wired in (on the CPU forced on: the interpreter runs them there)
# ---------------------------------------------------------------------------------------------

def test_model_greedy_tokens_match_the_torch_path(monkeypatch):
    """The decoder layer's fused residual-add layout and the three kernels give random:tiny's torch-path tokens."""
    from lockstep_engine import layers
    from lockstep_engine.llm import LLM
    from lockstep_engine.sampling_params import SamplingParams

    # eager: a CUDA graph captured at load would replay one path for both runs
    llm = LLM("random:tiny", device=DEVICE.type, dtype="float32", enforce_eager=True, num_scheduler_steps=1,
              num_gpu_blocks_override=64, max_num_seqs=4)
    prompts = [[1, 5, 9, 200, 31], [7, 7, 7], [100, 3, 44, 12, 9, 18, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    monkeypatch.setattr(layers, "fused_kernels_for", lambda x: None)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    monkeypatch.setattr(layers, "fused_kernels_for", lambda x: fused)
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == expected
