"""The device state a window carries from step to step, and the plan facts its loops branch on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep_engine.attention import AttentionMetadata
from lockstep_engine.runner.step_inputs import PromptRows
from lockstep_engine.sampler import SamplingTensors
from lockstep_engine.scheduler import WindowPlan


@dataclass
class DecodeState:
    """Device tensors of the sampling rows inside a window, [rows] unless noted."""

    tokens: torch.Tensor  # last sampled token: the next step's input
    positions: torch.Tensor  # position of that token
    table: torch.Tensor  # [rows, max_blocks] block table
    done: torch.Tensor  # bool: stopped or out of budget; writes go to the sink slot
    steps_done: torch.Tensor
    max_steps: torch.Tensor
    budget: torch.Tensor  # tokens the row could sample at the window's start before a length finish
    num_generated: torch.Tensor
    sampling: SamplingTensors
    counts: torch.Tensor | None  # [rows, vocab] output token counts (penalties)
    # [2, rows]: this step's token per row (-1 where the row was done before it) and its finish code
    emitted: torch.Tensor | None = None
    recent: torch.Tensor | None = None  # [rows, H] latest outputs, with bad words of several tokens
    lora_slots: torch.Tensor | None = None  # LoRA weight slot per row; None: no adapter among the rows


@dataclass
class FirstStep:
    """Device inputs of a window's first step, and what its sampling rows carry into the next steps."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    block_table: torch.Tensor  # [rows, max_blocks]
    seq_lens: torch.Tensor  # [rows] after step 1
    sample_index: torch.Tensor  # flattened token index of each sampling row's last token
    sample_sel: torch.Tensor  # row index of each sampling row
    sampling_rows: list
    sampling: SamplingTensors | None
    counts: torch.Tensor | None
    num_generated: torch.Tensor  # [sampling rows] output tokens before the window
    max_steps: torch.Tensor  # [sampling rows] tokens each may sample in the window
    budget: torch.Tensor  # [sampling rows] tokens each may sample before max_tokens / max_model_len
    max_dec_len: int  # longest sampling row after step 1
    prompt: PromptRows | None = None  # rows that asked for prompt logprobs, and their positions
    prompt_index: torch.Tensor | None = None  # [positions] flattened token index (`PromptRows`)
    prompt_targets: torch.Tensor | None = None  # [positions] the prompt token each position predicts
    recent: torch.Tensor | None = None  # [sampling rows, H] latest outputs before the window (bad words)
    # [sampling rows] bool: rows carried from the previous window that ended there on the device (their
    # finish reaches the host with that window's last step); None: no row is done at the start
    initial_done: torch.Tensor | None = None
    lora_rows: torch.Tensor | None = None  # [sampling rows] LoRA weight slots; None: no adapter among them


def has_guided_rows(rows) -> bool:
    return any(row.seq.request.params.guided_spec is not None for row in rows)


def first_step_phase(plan: WindowPlan) -> str:
    """prefill when the window's first forward computes prompt tokens (as `CoreStats` counts them)."""
    return "prefill" if any(row.num_new_tokens > 1 for row in plan.rows) else "decode"
