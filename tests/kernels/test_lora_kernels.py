"""The Triton LoRA kernels (bgmv shrink and expand) against the plain per-slot torch path.

On a machine without CUDA they run in Triton's interpreter (tests/kernels/conftest.py) at small
sizes; CUDA-graph capture with the slots changed between replays is GPU-only.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from lockstep_engine.lora.ops import add_lora_bgmv, add_lora_plain  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu_only = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


def stacked(num_slots: int, rank: int, in_size: int, out_size: int, num_slices: int, dtype, seed: int):
    """Random stacked A [slots, slices * rank, in] and B [slots, out, rank], slot 0 zeros, and the
    last slot an adapter of a smaller rank padded with zeros (what ModelLoRA.load stores)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, num_slices * rank, in_size, generator=gen) * 0.2
    b = torch.randn(num_slots, out_size, rank, generator=gen) * 0.2
    a[0], b[0] = 0, 0
    b[-1, :, rank // 2:] = 0
    for i in range(num_slices):
        a[-1, i * rank + rank // 2:(i + 1) * rank] = 0
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


CASES = {
    "qkv-like": (64, ((0, 32), (32, 16), (48, 16)), 8),  # three packed slices of different sizes
    "row-parallel-like": (96, ((0, 40),), 16),  # one slice, ragged sizes
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_bgmv_matches_the_plain_path_on_a_mixed_batch(case, dtype):
    in_size, slices, rank = CASES[case]
    out_size = sum(size for _, size in slices)
    a, b = stacked(4, rank, in_size, out_size, len(slices), dtype, seed=len(case))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(7, in_size, generator=gen).to(DEVICE, dtype)
    base = torch.randn(7, out_size, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([1, 0, 3, 3, 2, 0, 1], device=DEVICE)
    expected, out = base.clone(), base.clone()
    add_lora_plain(x, expected, a, b, slots, [1, 2, 3], slices)
    add_lora_bgmv(x, out, a, b, slots, slices)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(out[slots == 0], base[slots == 0])  # slot 0 adds zeros: base rows unchanged
    assert not torch.allclose(out.float(), base.float())


def test_bgmv_with_no_tokens_is_a_no_op():
    a, b = stacked(2, 4, 16, 8, 1, torch.float32, seed=1)
    y = torch.empty(0, 8, device=DEVICE)
    add_lora_bgmv(torch.empty(0, 16, device=DEVICE), y, a, b, torch.empty(0, dtype=torch.int64, device=DEVICE),
                  ((0, 8),))
    assert y.shape == (0, 8)


@gpu_only
def test_bgmv_replays_in_a_cuda_graph_with_new_slots():
    in_size, slices, rank = CASES["qkv-like"]
    out_size = sum(size for _, size in slices)
    a, b = stacked(4, rank, in_size, out_size, len(slices), torch.bfloat16, seed=3)
    x = torch.randn(6, in_size, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    y = torch.zeros(6, out_size, device=DEVICE, dtype=torch.bfloat16)
    add_lora_bgmv(x, y, a, b, slots, slices)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.zero_()
        add_lora_bgmv(x, y, a, b, slots, slices)
    for values in ([0] * 6, [1, 2, 3, 0, 2, 1], [3] * 6):
        slots.copy_(torch.tensor(values))
        graph.replay()
        expected = torch.zeros_like(y)
        add_lora_plain(x, expected, a, b, slots, sorted(set(values) - {0}), slices)
        torch.testing.assert_close(y.float(), expected.float(), atol=3e-2, rtol=3e-2)
