"""The picker: the candidate with the highest weighted sum of the policy's scores; among equals, power of
two choices by the tie-break score (two drawn at random, the higher wins; the first drawn on a tie).

The random draw among equals is what keeps several gateways (or `--workers`) that see the same loads from
all sending their next request to the same lightest engine, as an argmax would."""

from __future__ import annotations

import random
from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Candidate


def add_scores(totals: list[float], weight: float, scores: Sequence[float]) -> None:
    """Adds one scorer's weight x score to each candidate's running total."""
    for i, score in enumerate(scores):
        totals[i] += weight * score


def runaway(totals: Sequence[float], weight_to_come: float) -> int | None:
    """The candidate no scorer still to come can catch (scores are at most 1, so they add at most
    `weight_to_come`): the later scorers need not be asked. None while the lead is not that large."""
    leader = max(range(len(totals)), key=totals.__getitem__)
    others = [total for i, total in enumerate(totals) if i != leader]
    return leader if not others or totals[leader] - max(others) > weight_to_come else None


def pick(candidates: Sequence[Candidate], totals: Sequence[float], tie_break: Sequence[float],
         rng: random.Random) -> Candidate:
    best = max(totals)
    top = [i for i, total in enumerate(totals) if total == best]
    if len(top) == 1:
        return candidates[top[0]]
    first, second = rng.sample(top, 2)
    return candidates[first if tie_break[first] >= tie_break[second] else second]
