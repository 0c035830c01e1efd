"""A policy put to work: filters, then scorers, then the picker, over snapshots of the engines; and the
scorers' bookkeeping around it (what they read of a request, where it went, engines they forget).

Scorers are asked in the policy's order and the asking stops once one candidate leads by more than the
weights still to come: a session's engine is chosen without asking the prefix index or moving the
round-robin turn."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from lockstep_gateway.routing.candidate import Ask, Candidate, Incoming, Settings
from lockstep_gateway.routing.filters import DEFAULT_FILTERS, Filter
from lockstep_gateway.routing.picker import add_scores, pick, runaway
from lockstep_gateway.routing.scorers import LeastLoad, Scorer


@dataclass(frozen=True)
class Policy:
    # (scorer, weight): scores run from 0 to 1, so a weight says how many points a full score is worth
    scorers: tuple[tuple[Scorer, float], ...] = ()
    tie_break: Scorer = field(default_factory=LeastLoad)  # among equal sums (picker.py)
    filters: tuple[Filter, ...] = DEFAULT_FILTERS


class Router:
    def __init__(self, policy: Policy, settings: Settings, rng: random.Random | None = None):
        self.policy = policy
        self.settings = settings
        self.rng = rng or random.Random()
        self._scorers = [scorer for scorer, _ in policy.scorers] + [policy.tie_break]
        self._total_weight = sum(weight for _, weight in policy.scorers)

    def read(self, request: Incoming) -> dict[str, object]:
        """What the policy's scorers need of a request, by scorer name: kept with it for every choice."""
        hints = {}
        for scorer in self._scorers:
            hint = scorer.read(request)
            if hint is not None:
                hints[scorer.name] = hint
        return hints

    def choose(self, candidates: Sequence[Candidate], ask: Ask) -> Candidate | None:
        """The engine for the request among `candidates` (every engine known), None when no engine may take it."""
        for keep in self.policy.filters:
            candidates = keep(candidates, ask, self.settings)
            if not candidates:
                return None
        totals = [0.0] * len(candidates)
        weight_to_come = self._total_weight
        for scorer, weight in self.policy.scorers:  # the heaviest first (build_policy puts affinity first)
            add_scores(totals, weight, scorer.score(candidates, ask, self.settings))
            weight_to_come -= weight
            leader = runaway(totals, weight_to_come)
            if leader is not None:  # e.g. a session's engine: the round-robin turn does not move for it
                return candidates[leader]
        return pick(candidates, totals, self.policy.tie_break.score(candidates, ask, self.settings), self.rng)

    def routed(self, url: str, hints: dict[str, object]) -> None:
        for scorer in self._scorers:
            scorer.routed(url, hints.get(scorer.name))

    def forget(self, url: str) -> None:
        for scorer in self._scorers:
            scorer.forget(url)
