"""Routing decisions as pure functions over plain data: which engine gets the next request.

* least-load: power-of-two choices (two engines drawn at random, the lighter one wins) over a load
  score that combines the gateway's own in-flight count (exact, live) with the engine's scraped
  queue/running/KV-cache gauges (covering other gateways' traffic) while they are fresh;
* round-robin: a counter over the candidates;
* session affinity: a consistent-hash ring, so a session sticks to one engine and only the
  sessions of an engine that leaves or joins move.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

VIRTUAL_NODES = 160


@dataclass(frozen=True)
class EngineLoad:
    """An engine's load gauges at one scrape (vLLM's names)."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """What routing needs to know about one healthy engine."""

    url: str
    in_flight: int = 0
    load: EngineLoad | None = None
    load_age_s: float = float("inf")
    # The gateway's open requests on the engine when `load` was scraped: requests sent since are
    # not in the scraped queue yet, so a burst counts at once and not one scrape later.
    in_flight_at_scrape: int = 0


def load_score(candidate: Candidate, stale_after_s: float) -> float:
    """Lower is lighter. Scraped gauges older than `stale_after_s` are ignored (the engine may be gone)."""
    score = float(candidate.in_flight)
    load = candidate.load
    if load is not None and candidate.load_age_s <= stale_after_s:
        # Waiting requests count twice: they wait for the batch and then take a place in it.
        score = max(score, load.num_running + load.num_waiting) + load.num_waiting + load.kv_cache_usage
    return score


def is_saturated(candidate: Candidate, stale_after_s: float, queue_depth: int, max_in_flight: int) -> bool:
    """An engine takes no new request past either limit (0 = no limit)."""
    if max_in_flight and candidate.in_flight >= max_in_flight:
        return True
    return bool(queue_depth and predicted_waiting(candidate, stale_after_s) >= queue_depth)


def predicted_waiting(candidate: Candidate, stale_after_s: float) -> float:
    """The engine's waiting queue now: the scraped count plus what this gateway sent since the
    scrape; 0 without a fresh scrape (then only `max_in_flight` bounds an engine)."""
    load = candidate.load
    if load is None or candidate.load_age_s > stale_after_s:
        return 0.0
    return load.num_waiting + max(0, candidate.in_flight - candidate.in_flight_at_scrape)


def pick_least_load(candidates: Sequence[Candidate], stale_after_s: float, rng: random.Random) -> Candidate:
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(list(candidates), 2)
    first_score, second_score = load_score(first, stale_after_s), load_score(second, stale_after_s)
    if first_score == second_score:
        return first  # already a random draw
    return first if first_score < second_score else second


def pick_round_robin(candidates: Sequence[Candidate], counter: int) -> Candidate:
    ordered = sorted(candidates, key=lambda c: c.url)
    return ordered[counter % len(ordered)]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes; `preference(key)` lists every member, nearest first."""

    def __init__(self, members: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((_hash(f"{member}#{i}"), member) for member in set(members) for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._members = [m for _, m in points]
        self.size = len(set(members))

    def preference(self, key: str) -> list[str]:
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, _hash(key))
        order: list[str] = []
        for i in range(len(self._members)):
            member = self._members[(start + i) % len(self._members)]
            if member not in order:
                order.append(member)
                if len(order) == self.size:
                    break
        return order


def session_key(headers: dict[str, str], body: dict, header_name: str) -> str | None:
    """The affinity key: the session header if present, else the OpenAI `user` field."""
    value = headers.get(header_name.lower())
    if value:
        return "h:" + value
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user
    return None
