"""Prefix-aware scoring: the engine that most likely holds the request's prompt prefix in its KV cache.

The prompt's leading blocks are hashed, chained, at admission (`read`); a bounded LRU per engine remembers
the blocks sent there (`routed`), and an engine that leaves or is readmitted (it may have restarted) is
forgotten. The engine holding the longest prefix (the lightest of several) scores 1 while its load is
within a slack of the lightest engine's; otherwise nobody scores and load decides, and the prefix is then
remembered on the engine load chose too, so a hot prefix spreads over as many engines as its load needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Ask, Candidate, Incoming, Settings, load_score
from lockstep_gateway.routing.scorers import Scorer

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


class PrefixCache(Scorer):
    name = "prefix-cache"

    def __init__(self, capacity: int = PREFIX_INDEX_BLOCKS):
        self.index = PrefixIndex(capacity)

    def read(self, request: Incoming) -> tuple[int, ...] | None:
        return (prefix_hashes(request.payload, request.model) or None) if request.generation else None

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        hashes = ask.hints.get(self.name)
        if not hashes:
            return [0.0] * len(candidates)
        matches = [self.index.match(c.url, hashes) for c in candidates]
        holder = prefix_holder(candidates, matches, settings.stale_after_s)
        return [1.0 if i == holder else 0.0 for i in range(len(candidates))]

    def routed(self, url: str, hint: object | None) -> None:
        if hint:
            self.index.record(url, hint)

    def forget(self, url: str) -> None:
        self.index.forget(url)


def prefix_holder(candidates: Sequence[Candidate], matches: Sequence[int], stale_after_s: float) -> int | None:
    """The index of the candidate holding the longest prefix (the lightest of several, the first of equals)
    while its load stays within the slack of the lightest candidate's; None when none matches or it is
    busier than that."""
    best = max(matches, default=0)
    if not best:
        return None
    loads = [load_score(c, stale_after_s) for c in candidates]
    lightest = min(loads)
    holder = min((i for i, m in enumerate(matches) if m == best), key=loads.__getitem__)
    if loads[holder] <= max(lightest + PREFIX_SLACK_ABS, lightest * PREFIX_SLACK_REL):
        return holder
    return None


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
