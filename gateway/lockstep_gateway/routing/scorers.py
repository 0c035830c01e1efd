"""Scorers: how much a policy prefers each candidate, from 0 to 1, higher is better.

A scorer is an object with a `name` and `score(candidates, ask, settings)`; one that needs something of the
request (its prompt, a session key) reads it once at admission (`read`, stored in `Ask.hints` under its
name), and one with state learns where requests went (`routed`) and forgets an engine that left or
restarted (`forget`). The stateless scorers every policy may use live here; the stateful ones have a
module of their own (prefix.py, affinity.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Ask, Candidate, Incoming, Settings, load_score


class Scorer:
    name = ""

    def read(self, request: Incoming) -> object | None:
        """What this scorer needs of the request, kept for every choice made for it; None: nothing."""
        return None

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        raise NotImplementedError

    def routed(self, url: str, hint: object | None) -> None:
        """The request (with what `read` returned) was sent to this engine."""

    def forget(self, url: str) -> None:
        """The engine left, or came back and may have restarted: what was learnt of it is gone."""


class LeastLoad(Scorer):
    """The negated load (`load_score`): the picker's tie-break, not normalised, since only the order of
    two candidates counts there."""

    name = "least-load"

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        return [-load_score(c, settings.stale_after_s) for c in candidates]


class RoundRobin(Scorer):
    """1 for the next engine in turn (by URL), 0 for the others; the turn moves at every choice."""

    name = "round-robin"

    def __init__(self) -> None:
        self.turn = 0

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        self.turn += 1
        chosen = next_in_turn([c.url for c in candidates], self.turn)
        return [1.0 if c.url == chosen else 0.0 for c in candidates]


def next_in_turn(urls: Sequence[str], turn: int) -> str:
    """The engine whose turn it is: the URLs in a stable order, taken cyclically."""
    ordered = sorted(urls)
    return ordered[turn % len(ordered)]
