"""Routing decisions as pure functions over plain data: which engine gets the next request.

* least-load: power-of-two choices (two engines drawn at random, the lighter one wins) over a load
  score that combines the gateway's own in-flight count (exact, live) with the engine's scraped
  queue/running/KV-cache gauges (covering other gateways' traffic) while they are fresh;
* round-robin: a counter over the candidates;
* session affinity: a consistent-hash ring, so a session sticks to one engine and only the
  sessions of an engine that leaves or joins move;
* prefix-aware: the engine that most likely holds the request's prompt prefix in its KV cache
  (chained hashes of the prompt's leading blocks, remembered per engine in a bounded LRU), unless
  it is busier than the lightest engine by more than a slack: then least-load, and the prefix is
  remembered on that engine too, so a hot prefix spreads over as many engines as its load needs.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

VIRTUAL_NODES = 160
# Prefix blocks: the engine caches whole KV blocks of 16 tokens (its default --block-size); text is
# cut into 64 characters, about 16 tokens of English. Only the leading blocks are hashed: past
# MAX_PREFIX_BLOCKS (4096 tokens) the routing decision hardly changes and hashing costs more.
PREFIX_BLOCK_TOKENS = 16
PREFIX_BLOCK_CHARS = 64
MAX_PREFIX_BLOCKS = 256
# Blocks remembered per engine (an 8B model on one H200 holds some 30k blocks of 16 tokens).
PREFIX_INDEX_BLOCKS = 32768
# The prefix's engine wins while its load is within this slack of the lightest engine's:
# at most PREFIX_SLACK_ABS more, or up to PREFIX_SLACK_REL times it.
PREFIX_SLACK_ABS = 4.0
PREFIX_SLACK_REL = 1.25


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
    # The most requests the engine was seen running at once (its batch, as far as it filled); 0 before
    # any scrape.
    seats: int = 0


def load_score(candidate: Candidate, stale_after_s: float) -> float:
    """Lower is lighter. Scraped gauges older than `stale_after_s` are ignored (the engine may be gone)."""
    score = float(candidate.in_flight)
    load = candidate.load
    if load is not None and candidate.load_age_s <= stale_after_s:
        # Waiting requests count twice: they wait for the batch and then take a place in it.
        score = max(score, load.num_running + load.num_waiting) + load.num_waiting + load.kv_cache_usage
    return score


def is_saturated(candidate: Candidate, stale_after_s: float, queue_depth: int, max_in_flight: int) -> bool:
    """An engine takes no new request past either limit (0 = no limit). With a queue depth, this
    gateway also keeps at most the engine's seen batch plus that depth open on it: requests still in
    transit, or not yet parsed by a busy engine, are in no scraped queue, and a busy engine's scrapes
    go stale (a burst of 10,000 was all sent on, and ran the gateway out of file descriptors)."""
    if max_in_flight and candidate.in_flight >= max_in_flight:
        return True
    if not queue_depth:
        return False
    return candidate.in_flight >= candidate.seats + queue_depth \
        or predicted_waiting(candidate, stale_after_s) >= queue_depth


def predicted_waiting(candidate: Candidate, stale_after_s: float) -> float:
    """The engine's waiting queue now: the scraped count plus what this gateway sent since the
    scrape, less what ended since (each ended request lets a waiting one into the batch); 0 without
    a fresh scrape (then only `max_in_flight` bounds an engine)."""
    load = candidate.load
    if load is None or candidate.load_age_s > stale_after_s:
        return 0.0
    return max(0.0, load.num_waiting + candidate.in_flight - candidate.in_flight_at_scrape)


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


# ---- prefix-aware routing ----------------------------------------------------------------------
def prefix_hashes(payload: dict, model: str) -> tuple[int, ...]:
    """Chained hashes of the prompt's leading whole blocks (hash k covers blocks 0..k), so two
    requests share hash k exactly when their first k+1 blocks are equal. Token-id prompts are cut
    into PREFIX_BLOCK_TOKENS ids, text into PREFIX_BLOCK_CHARS characters; a chat's messages are
    joined in order (role and content), which approximates the rendered prompt's prefix. A batch of
    prompts is routed by its first. Anything else (no prompt, odd shapes) gives no hashes."""
    prompt = _prompt_of(payload)
    if isinstance(prompt, str):
        size = PREFIX_BLOCK_CHARS
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt[:MAX_PREFIX_BLOCKS * PREFIX_BLOCK_TOKENS]):
        size = PREFIX_BLOCK_TOKENS
    else:
        return ()
    hashes = []
    chained = hash(model)
    for start in range(0, min(len(prompt) // size, MAX_PREFIX_BLOCKS) * size, size):
        block = prompt[start:start + size]
        chained = hash((chained, block if isinstance(block, str) else tuple(block)))
        hashes.append(chained)
    return tuple(hashes)


def _prompt_of(payload: dict):
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if isinstance(content, list):  # content parts: the text ones count
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
            parts.append(f"{message.get('role')}\x00{content if isinstance(content, str) else ''}\x01")
        return "".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt[0]  # a batch of prompts
    return prompt


class PrefixIndex:
    """Which prefix blocks each engine was sent lately: a bounded LRU of block hashes per engine.
    Approximate: the engine may have evicted a block since, or never finished the request."""

    def __init__(self, capacity: int = PREFIX_INDEX_BLOCKS):
        self.capacity = capacity
        self.engines: dict[str, OrderedDict[int, None]] = {}

    def match(self, url: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the engine likely holds."""
        blocks = self.engines.get(url)
        if not blocks:
            return 0
        matched = 0
        for block in hashes:
            if block not in blocks:
                break
            matched += 1
        return matched

    def record(self, url: str, hashes: Sequence[int]) -> None:
        blocks = self.engines.setdefault(url, OrderedDict())
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, url: str) -> None:
        """The engine left or restarted: its cache is gone."""
        self.engines.pop(url, None)


def pick_prefix_aware(candidates: Sequence[Candidate], matches: Sequence[int], stale_after_s: float,
                      rng: random.Random) -> Candidate:
    """The engine holding the longest prefix (the lightest of several), while its load stays
    within the slack of the lightest engine's; otherwise least-load."""
    best = max(matches, default=0)
    if best:
        loads = [load_score(c, stale_after_s) for c in candidates]
        lightest = min(loads)
        holder = min((i for i, m in enumerate(matches) if m == best), key=loads.__getitem__)
        if loads[holder] <= max(lightest + PREFIX_SLACK_ABS, lightest * PREFIX_SLACK_REL):
            return candidates[holder]
    return pick_least_load(candidates, stale_after_s, rng)
