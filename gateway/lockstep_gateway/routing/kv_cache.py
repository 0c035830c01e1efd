"""The `kv-cache` policy: the engines with the most free KV cache, to a tenth, then least-load among them.

For long prompts the KV cache runs out before the batch's seats do, and an engine that fills it preempts
and recomputes. Free cache is counted in tenths so that engines about as full tie and load decides between
them, rather than every request going to the one engine a scrape showed a little emptier. An engine
without a fresh scrape (`--metrics-stale`) scores 0: nothing says it has room."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Ask, Candidate, Settings
from lockstep_gateway.routing.router import Policy
from lockstep_gateway.routing.scorers import Scorer


class KVCacheHeadroom(Scorer):
    name = "kv-cache-headroom"

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        return [free_tenths(c, settings.stale_after_s) for c in candidates]


def free_tenths(candidate: Candidate, stale_after_s: float) -> float:
    """The free share of the engine's KV cache, rounded down to a tenth; 0 without a fresh scrape."""
    load = candidate.load
    if load is None or candidate.load_age_s > stale_after_s:
        return 0.0
    return math.floor(max(0.0, 1.0 - load.kv_cache_usage) * 10 + 1e-9) / 10  # 1 - 0.9 is 0.0999...


def policy() -> Policy:
    return Policy(scorers=((KVCacheHeadroom(), 1.0),))
