"""The LoRA term of a batch whose tokens use different adapters: y[t] += (x[t] @ A[s]^T) @ B[s]^T, s = slots[t].

Stacked weights (one row per slot, slot 0 all zeros for the base model):
  a: [slots, num_slices * rank, in]  one A per sub-projection of a packed layer (q, k, v / gate, up)
  b: [slots, out, rank]              B's rows in the layer's output order; slice i of the output
                                     (`slices[i]` = (offset, size)) reads columns i*rank.. of the shrink

Two paths, the same sum:
* `add_lora_plain` (the CPU, eager CUDA without Triton): for each adapter slot present, the rows of
  its tokens, two matmuls, an index_add. The caller gives the distinct non-zero slots (host ints).
* `add_lora_grouped` (CUDA): Triton kernels (`kernels.py`) over the tokens grouped by slot on the
  device, one matmul tile per BLOCK_M tokens of an adapter; no host sync, so it can be captured in a
  CUDA graph.
"""

from __future__ import annotations

import functools

import torch


def add_lora_plain(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                   active: list[int], slices: tuple[tuple[int, int], ...]) -> None:
    """x: [tokens, in]; y: [tokens, out], added to in place; slots: [tokens] int64; `active`: the
    distinct non-zero slots among `slots`."""
    rank = b.shape[-1]
    for slot in active:
        rows = (slots == slot).nonzero().squeeze(1)
        shrink = x.index_select(0, rows) @ a[slot].t()  # [rows, num_slices * rank]
        parts = [shrink[:, i * rank:(i + 1) * rank] @ b[slot, offset:offset + size].t()
                 for i, (offset, size) in enumerate(slices)]
        y.index_add_(0, rows, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


def add_lora_grouped(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups,
                     slices: tuple[tuple[int, int], ...]) -> None:
    """The same sum as `add_lora_plain` in Triton kernels; `groups`: `kernels.group` of the tokens' slots
    (computed once per forward and shared by every layer)."""
    from lockstep_engine.lora import kernels

    kernels.expand(kernels.shrink(x, a, groups), b, groups, y, slices)


@functools.cache
def triton_available() -> bool:
    try:
        from lockstep_engine.lora import kernels  # noqa: F401
    except ImportError:
        return False
    return True
