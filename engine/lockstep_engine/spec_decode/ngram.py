"""N-gram prompt lookup with tensor ops (no host sync, so it can run on the device inside a window).

For each row, the longest suffix of its tokens (prompt and outputs) of `prompt_lookup_max` down to
`prompt_lookup_min` tokens that occurred earlier in the row proposes the tokens that followed its
latest earlier occurrence. When fewer than K tokens follow that occurrence, the continuation repeats
with the period the match implies (a text that repeats itself keeps being proposed).
"""

from __future__ import annotations

import torch


def propose_ngram(history: torch.Tensor, lengths: torch.Tensor, k: int, n_min: int,
                  n_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """history: [rows, W] int64 tokens (valid below `lengths` [rows]). Returns drafts [rows, k] (0 where a
    row found nothing) and found [rows] bool."""
    rows, width = history.shape
    device = history.device
    drafts = torch.zeros(rows, k, dtype=torch.int64, device=device)
    found = torch.zeros(rows, dtype=torch.bool, device=device)
    offsets = torch.arange(k, device=device)
    for n in range(n_max, n_min - 1, -1):
        if width < n + 1:
            continue
        suffix_index = (lengths.unsqueeze(1) - n + torch.arange(n, device=device)).clamp(min=0)
        suffix = history.gather(1, suffix_index)  # [rows, n]
        windows = history.unfold(1, n, 1)  # [rows, W - n + 1, n]
        starts = torch.arange(windows.shape[1], device=device)
        # A match ends before the last token (so a token follows it), which also excludes the suffix itself.
        match = (windows == suffix.unsqueeze(1)).all(dim=-1) & (starts.unsqueeze(0) + n < lengths.unsqueeze(1))
        match &= (lengths > n).unsqueeze(1)
        latest = torch.where(match, starts.unsqueeze(0), -1).amax(dim=1)  # [rows]
        hit = (latest >= 0) & ~found
        follow = latest + n  # first token after the match
        period = (lengths - follow).clamp(min=1)
        index = (follow.unsqueeze(1) + offsets.unsqueeze(0) % period.unsqueeze(1)).clamp(0, width - 1)
        drafts = torch.where(hit.unsqueeze(1), history.gather(1, index), drafts)
        found |= hit
    return drafts, found
