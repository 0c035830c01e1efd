"""The Triton LoRA kernels (tokens grouped by slot, shrink and expand) against the plain per-slot torch path.

On a machine without CUDA they run in Triton's interpreter (tests/kernels/conftest.py) at small
sizes; CUDA-graph capture with the slots changed between replays is GPU-only.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from lockstep_engine.lora import kernels  # noqa: E402
from lockstep_engine.lora.ops import add_lora_grouped, add_lora_plain  # noqa: E402

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
    # name: (in size, slices of the output, rank, tokens)
    "qkv-like": (64, ((0, 32), (32, 16), (48, 16)), 8, 7),  # three packed slices, one launch (16-wide tiles)
    "row-parallel-like": (96, ((0, 40),), 16, 7),  # one slice, ragged sizes
    "slices-off-tile": (48, ((0, 24), (24, 8), (32, 8)), 4, 7),  # a boundary inside a tile: a launch per slice
    "split-k, many tokens": (640, ((0, 64), (64, 64)), 8, 150),  # K split over programs; 32-token tiles
}


def add_both(case, dtype, slots=None):
    in_size, slices, rank, tokens = CASES[case]
    out_size = sum(size for _, size in slices)
    a, b = stacked(4, rank, in_size, out_size, len(slices), dtype, seed=len(case))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, in_size, generator=gen).to(DEVICE, dtype)
    base = torch.randn(tokens, out_size, generator=gen).to(DEVICE, dtype)
    if slots is None:
        slots = torch.randint(0, 4, (tokens,), generator=gen).to(DEVICE)
    expected, out = base.clone(), base.clone()
    add_lora_plain(x, expected, a, b, slots, sorted(set(slots.tolist()) - {0}), slices)
    add_lora_grouped(x, out, a, b, kernels.group(slots, 4), slices)
    return base, expected, out, slots


def test_group_orders_the_tokens_of_each_adapter_slot_stably():
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 5, 300, 2100):  # below, within and across the kernel's 1024-token blocks
        slots = torch.randint(0, 5, (tokens,), generator=gen).to(DEVICE)
        groups = kernels.group(slots, 5)
        expected = torch.argsort(slots.cpu(), stable=True)
        skip = int((slots == 0).sum())  # slot 0 (the base model) is in no group
        for slot in range(1, 5):
            count, start = int(groups.counts[slot]), int(groups.starts[slot])
            assert count == int((slots == slot).sum())
            assert start == int((slots < slot).sum())
            assert groups.order[start:start + count].tolist() == expected[start:start + count].tolist()
        assert skip + int(groups.counts[1:].sum()) == tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_kernels_match_the_plain_path_on_a_mixed_batch(case, dtype):
    base, expected, out, slots = add_both(case, dtype)
    atol, rtol = TOL[dtype]
    atol *= max(1.0, (CASES[case][0] / 64) ** 0.5)  # bf16 rounding of the shrink grows with its length
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(out[slots == 0], base[slots == 0])  # slot 0 adds zeros: base rows unchanged
    assert not torch.allclose(out.float(), base.float())


def test_grouped_kernels_give_the_same_bits_for_the_same_batch():
    """No atomics: K's split partials are summed in a fixed order, so a rerun is bit-identical."""
    _, _, first, slots = add_both("split-k, many tokens", torch.bfloat16)
    _, _, second, _ = add_both("split-k, many tokens", torch.bfloat16, slots)
    assert torch.equal(first, second)


def test_a_batch_of_base_model_tokens_only_is_left_unchanged():
    base, _, out, _ = add_both("qkv-like", torch.float32, torch.zeros(7, dtype=torch.int64, device=DEVICE))
    assert torch.equal(out, base)


def test_grouped_kernels_with_no_tokens_are_a_no_op():
    a, b = stacked(2, 4, 16, 8, 1, torch.float32, seed=1)
    y = torch.empty(0, 8, device=DEVICE)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    add_lora_grouped(torch.empty(0, 16, device=DEVICE), y, a, b, kernels.group(slots, 2), ((0, 8),))
    assert y.shape == (0, 8)


@gpu_only
def test_grouped_kernels_replay_in_a_cuda_graph_with_new_slots():
    """The grouping runs on the device inside the graph: each replay follows the slots copied in."""
    in_size, slices, rank, _ = CASES["qkv-like"]
    out_size = sum(size for _, size in slices)
    a, b = stacked(4, rank, in_size, out_size, len(slices), torch.bfloat16, seed=3)
    x = torch.randn(6, in_size, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    y = torch.zeros(6, out_size, device=DEVICE, dtype=torch.bfloat16)
    add_lora_grouped(x, y, a, b, kernels.group(slots, 4), slices)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.zero_()
        add_lora_grouped(x, y, a, b, kernels.group(slots, 4), slices)
    for values in ([0] * 6, [1, 2, 3, 0, 2, 1], [3] * 6):
        slots.copy_(torch.tensor(values))
        graph.replay()
        expected = torch.zeros_like(y)
        add_lora_plain(x, expected, a, b, slots, sorted(set(values) - {0}), slices)
        torch.testing.assert_close(y.float(), expected.float(), atol=3e-2, rtol=3e-2)
