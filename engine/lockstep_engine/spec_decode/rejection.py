"""Verification of K drafted tokens per row against the target's distributions at K + 1 positions.

Greedy rows accept a draft while it equals the target's argmax; the first mismatch is replaced by the
argmax (the bonus token when every draft matched). Sampling rows use standard speculative rejection
sampling: draft j is accepted with probability min(1, p_j(d) / q_j(d)) (q one-hot for n-gram drafts: p_j(d)),
and the first rejected position samples from the normalized max(p_j - q_j, 0); when all K are accepted
the bonus token samples from p_K. The tokens then follow the target's distribution exactly.

Draws are counter-based like the sampler's (seed, output index, token), from streams of their own, so a
seeded request's speculative output is reproducible whatever its batch or window.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lockstep_engine.sampler import Sampler, SamplingTensors, exponential_noise

# Seeds of the three random streams speculation draws from (xor-ed into the row's seed).
ACCEPT_STREAM = 0x5EC0_0001
RESIDUAL_STREAM = 0x5EC0_0002
DRAFT_STREAM = 0x5EC0_0003
_PER_ROW = ("temperature", "top_k", "top_p", "min_p", "seeds", "stop_ids", "min_tokens", "presence", "frequency",
            "repetition", "prompt_mask", "logit_bias")


def expand_rows(t: SamplingTensors, repeats: int) -> SamplingTensors:
    """`t` with every row repeated `repeats` times (one row per verified position)."""
    changes = {name: getattr(t, name).repeat_interleave(repeats, dim=0) for name in _PER_ROW
               if getattr(t, name) is not None}
    return replace(t, **changes)


def position_counts(num_generated: torch.Tensor, positions: int) -> torch.Tensor:
    """[rows * positions]: the output index of each position (min_tokens and the draws depend on it)."""
    return (num_generated.unsqueeze(1) + torch.arange(positions, device=num_generated.device)).flatten()


def uniform(seeds: torch.Tensor, steps: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform (0, 1) draws, one per (seed, step), from a stream of their own."""
    return torch.exp(-exponential_noise(seeds ^ stream, steps, 1).squeeze(1))


def sample_from(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, stream: int) -> torch.Tensor:
    """One token per row of unnormalized `probs` [rows, vocab] (the exponential race: argmax p / Exp(1))."""
    return (probs / exponential_noise(seeds ^ stream, steps, probs.shape[1])).argmax(dim=-1)


def draft_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """A distribution normalized to 1 per row (the filters leave mass out)."""
    probs = Sampler.probs(logits, t)
    return probs / probs.sum(dim=-1, keepdim=True)


def verify(logits: torch.Tensor, drafts: torch.Tensor, draft_q: torch.Tensor | None, t: SamplingTensors,
           steps: torch.Tensor, proposed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [rows, K + 1, vocab] processed target logits (`Sampler.processed_logits`); drafts: [rows, K];
    draft_q: [rows, K, vocab] the draft's distributions (None: one-hot drafts, n-gram or greedy);
    t: the sampling tensors expanded per position (`expand_rows`); steps: [rows * (K + 1)] output indices.
    proposed: [rows] bool, None for all: a row that proposed nothing accepts no draft and takes its first
    token from the target at its own position (argmax, or a draw from p_0 rather than a residual); its
    later positions' logits are not read.
    Returns tokens [rows, K + 1] (the first `accepted + 1` are the step's output) and accepted [rows]
    (drafts accepted, 0..K)."""
    rows, positions, vocab = logits.shape
    k = positions - 1
    greedy_tokens = logits.argmax(dim=-1)  # [rows, K + 1]
    greedy_accepted = (drafts == greedy_tokens[:, :k]).long().cumprod(dim=1).sum(dim=1)
    if proposed is not None:
        greedy_accepted = greedy_accepted * proposed
    if t.all_greedy:
        return greedy_tokens, greedy_accepted
    probs = draft_probs(logits.reshape(rows * positions, vocab), t).view(rows, positions, vocab)
    p_draft = probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [rows, K]
    draws = uniform(t.seeds, steps, ACCEPT_STREAM).view(rows, positions)[:, :k]
    if draft_q is None:
        accept = draws < p_draft
        residual = probs[:, :k].scatter(2, drafts.unsqueeze(2), 0.0)  # max(p - onehot(d), 0)
    else:
        q_draft = draft_q.gather(2, drafts.unsqueeze(2)).squeeze(2)
        accept = draws * q_draft < p_draft
        residual = (probs[:, :k] - draft_q).clamp(min=0.0)
    if proposed is not None:  # no draft to reject: the first token is a plain draw from p_0
        accept = accept & proposed.unsqueeze(1)
        residual = torch.where(proposed.view(rows, 1, 1), residual, probs[:, :k])
    # A residual with no mass left (p <= q everywhere) can only follow an accepted draft: keep p there.
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, probs[:, :k], residual)
    replacement = sample_from(torch.cat((residual, probs[:, k:]), dim=1).reshape(rows * positions, vocab),
                              t.seeds, steps, RESIDUAL_STREAM).view(rows, positions)
    accepted = accept.long().cumprod(dim=1).sum(dim=1)
    index = torch.arange(positions, device=logits.device).unsqueeze(0)
    padded = torch.nn.functional.pad(drafts, (0, 1))  # [rows, K + 1]: position K is never a draft
    sampled = torch.where(index < accepted.unsqueeze(1), padded, replacement)
    greedy = (t.temperature <= 0).view(rows, positions)[:, 0]
    tokens = torch.where(greedy.unsqueeze(1), greedy_tokens, sampled)
    return tokens, torch.where(greedy, greedy_accepted, accepted)
