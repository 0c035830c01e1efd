"""The picker: the candidate with the highest weighted sum of the policy's scores; among equals, power of
two choices by the tie-break score (two drawn at random, the higher wins; the first drawn on a tie).

The random draw among equals is what keeps several gateways (or `--workers`) that see the same loads from
all sending their next request to the same lightest engine, as an argmax would."""

from __future__ import annotations

import random
from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Candidate


def weighted_sum(scored: Sequence[tuple[float, Sequence[float]]], size: int) -> list[float]:
    """Per candidate, the sum of weight x score over (weight, scores) pairs."""
    totals = [0.0] * size
    for weight, scores in scored:
        for i, score in enumerate(scores):
            totals[i] += weight * score
    return totals


def pick(candidates: Sequence[Candidate], scored: Sequence[tuple[float, Sequence[float]]],
         tie_break: Sequence[float], rng: random.Random) -> Candidate:
    totals = weighted_sum(scored, len(candidates))
    best = max(totals)
    top = [i for i, total in enumerate(totals) if total == best]
    if len(top) == 1:
        return candidates[top[0]]
    first, second = rng.sample(top, 2)
    return candidates[first if tie_break[first] >= tie_break[second] else second]
