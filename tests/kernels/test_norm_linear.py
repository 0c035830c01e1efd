"""`norm_linear` (residual add + RMSNorm + projection, optionally SiLU-and-mul) against the unfused torch
path of layers.py (`RMSNorm`, `F.linear`, `silu_and_mul`) on random inputs, on the CPU as the reference.

On a machine without CUDA the kernel runs in Triton's interpreter at small sizes (ragged ones: a hidden
size and widths that are not multiples of the tiles); SmolLM2 and Llama-3-8B sizes and CUDA-graph capture
are GPU-only. The dot accumulates in another order than the reference's matmul, so results are compared
within a tolerance: fp32 tightly, bf16 within its rounding.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="triton is not installed")

from lockstep_engine.kernels.norm_linear import norm_linear, tiles  # noqa: E402
from lockstep_engine.layers import RMSNorm, silu_and_mul  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="GPU-only size (CPU runs use Triton's interpreter at small sizes)")
TOL = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2)}
EPS = 1e-5


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype)


def reference(x, residual, norm_weight, weight, silu_mul):
    """The unfused layer on the CPU: (y, h)."""
    norm = RMSNorm(x.shape[1], EPS).to(dtype=x.dtype)
    norm.weight.data.copy_(norm_weight)
    if residual is None:
        h, normed = x, norm(x)
    else:
        normed, h = norm(x, residual)
    y = F.linear(normed, weight)
    return (silu_and_mul(y) if silu_mul else y), h


def check(tokens, hidden, width, dtype, silu_mul, with_residual, seed=0):
    rows = 2 * width if silu_mul else width
    x = randn(tokens, hidden, dtype=dtype, seed=seed)
    residual = randn(tokens, hidden, dtype=dtype, seed=seed + 1) if with_residual else None
    norm_weight = randn(hidden, dtype=dtype, seed=seed + 2, scale=0.2) + 1
    weight = randn(rows, hidden, dtype=dtype, seed=seed + 3, scale=hidden ** -0.5)
    expected_y, expected_h = reference(x, residual, norm_weight, weight, silu_mul)
    y, h = norm_linear(x.to(DEVICE), None if residual is None else residual.to(DEVICE), norm_weight.to(DEVICE),
                       EPS, weight.to(DEVICE), silu_mul=silu_mul)
    assert y.shape == (tokens, width) and y.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.cpu().float(), expected_y.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(h.cpu().float(), expected_h.float(), atol=atol, rtol=rtol)
    return y, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("tokens,hidden,width", [(1, 64, 48), (5, 96, 160), (37, 160, 40)])
def test_matches_the_unfused_layer(tokens, hidden, width, dtype, silu_mul):
    check(tokens, hidden, width, dtype, silu_mul, with_residual=True)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_without_a_residual_h_is_x_itself(silu_mul):
    """The first layer: no residual yet, the norm reads the embeddings and h is them, not a copy."""
    x = randn(3, 64, dtype=torch.float32, seed=4).to(DEVICE)
    weight = randn(64 if silu_mul else 32, 64, dtype=torch.float32, seed=5, scale=0.125).to(DEVICE)
    y, h = norm_linear(x, None, torch.ones(64, device=DEVICE), EPS, weight, silu_mul=silu_mul)
    assert h is x
    expected, _ = reference(x.cpu(), None, torch.ones(64), weight.cpu(), silu_mul)
    torch.testing.assert_close(y.cpu(), expected, atol=2e-4, rtol=2e-4)


def test_strided_rows_as_the_model_passes_them():
    """x may be a view with strided rows (attention's output reshaped, a split); its last dim is contiguous."""
    wide = randn(6, 200, dtype=torch.float32, seed=6)
    x, residual = wide[:, :96], randn(6, 96, dtype=torch.float32, seed=7)
    norm_weight, weight = torch.ones(96), randn(40, 96, dtype=torch.float32, seed=8, scale=0.1)
    y, h = norm_linear(x.to(DEVICE), residual.to(DEVICE), norm_weight.to(DEVICE), EPS, weight.to(DEVICE))
    expected_y, expected_h = reference(x, residual, norm_weight, weight, False)
    torch.testing.assert_close(y.cpu(), expected_y, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(h.cpu(), expected_h, atol=1e-6, rtol=1e-6)


def test_no_tokens_and_a_weight_that_does_not_fit_the_hidden_size():
    empty = torch.empty(0, 64, device=DEVICE)
    y, h = norm_linear(empty, empty, torch.ones(64, device=DEVICE), EPS, torch.ones(32, 64, device=DEVICE))
    assert y.shape == (0, 32) and h.shape == (0, 64)
    with pytest.raises(ValueError, match=r"weight must be \[width, 64\]"):
        norm_linear(torch.ones(2, 64, device=DEVICE), None, torch.ones(64, device=DEVICE), EPS,
                    torch.ones(32, 48, device=DEVICE))


def test_tiles_stay_small_for_few_tokens_and_fp32():
    assert tiles(8, 960, torch.bfloat16)["BLOCK_M"] == 16
    assert tiles(256, 960, torch.bfloat16)["BLOCK_M"] == 64
    assert tiles(256, 14336, torch.bfloat16)["BLOCK_N"] == 64
    assert tiles(256, 14336, torch.float32)["BLOCK_N"] == 32


@gpu_only
@pytest.mark.parametrize("tokens", [1, 64, 256])
@pytest.mark.parametrize("hidden,width,silu_mul", [(576, 960, False), (576, 1536, True),  # SmolLM2-135M
                                                   (4096, 6144, False), (4096, 14336, True)])  # Llama-3-8B
def test_model_sizes_on_the_gpu(tokens, hidden, width, silu_mul):
    check(tokens, hidden, width, torch.bfloat16, silu_mul, with_residual=True, seed=tokens)


@gpu_only
def test_captures_in_a_cuda_graph():
    x = randn(64, 576, dtype=torch.bfloat16, seed=9).to(DEVICE)
    residual = randn(64, 576, dtype=torch.bfloat16, seed=10).to(DEVICE)
    norm_weight = torch.ones(576, dtype=torch.bfloat16, device=DEVICE)
    weight = randn(3072, 576, dtype=torch.bfloat16, seed=11, scale=0.04).to(DEVICE)
    eager, _ = norm_linear(x, residual, norm_weight, EPS, weight, silu_mul=True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = norm_linear(x, residual, norm_weight, EPS, weight, silu_mul=True)
    x.mul_(0.5)
    graph.replay()
    expected, _ = norm_linear(x, residual, norm_weight, EPS, weight, silu_mul=True)
    assert torch.equal(captured, expected) and not torch.equal(captured, eager)


def test_a_models_logits_with_the_fused_layers_match_the_unfused_ones(monkeypatch):
    """The decoder layer's fused path (switched on by LOCKSTEP_NORM_LINEAR=1 on CUDA; here made to run on the
    CPU tensors under the interpreter) against its unfused path, on a seeded random two-layer model."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))
    from lora_cases import TP_CONFIG, prefill_logits

    from lockstep_engine.attention import TorchPagedAttention
    from lockstep_engine.kernels import norm_linear as module
    from lockstep_engine.models import llama
    from lockstep_engine.models.llama import LlamaForCausalLM
    from lockstep_engine.parallel import ParallelState
    from lockstep_engine.sources import _weight_names

    torch.manual_seed(0)
    c = TP_CONFIG
    model = LlamaForCausalLM(c, ParallelState(), TorchPagedAttention(c.num_attention_heads, 1, c.head_dim, 16))
    model.load_weights((name, torch.randn(shape) * 0.2) for name, shape in _weight_names(c))
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32]]
    unfused = prefill_logits(model, prompts)
    calls = []

    def selector(x):
        calls.append(x.shape[0])
        return module

    monkeypatch.setattr(llama, "norm_linear_for", selector)
    fused = prefill_logits(model, prompts)
    assert calls == [15] * c.num_hidden_layers  # every layer took the fused path
    torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-4)


def test_a_tile_shape_given_is_used_and_gives_the_same_result():
    """benchmarks/norm_linear_sweep.py times other tiles through `config`: they must compute the same thing."""
    x, residual = randn(20, 96, dtype=torch.float32, seed=12), randn(20, 96, dtype=torch.float32, seed=13)
    norm_weight, weight = torch.ones(96), randn(80, 96, dtype=torch.float32, seed=14, scale=0.1)
    args = (x.to(DEVICE), residual.to(DEVICE), norm_weight.to(DEVICE), EPS, weight.to(DEVICE), True)
    default, _ = norm_linear(*args)
    other = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=1)
    assert other != tiles(20, 40, torch.float32)
    tiled, _ = norm_linear(*args, config=other)
    torch.testing.assert_close(tiled, default, atol=1e-5, rtol=1e-5)
