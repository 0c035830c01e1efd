"""Per-key rate limits: token buckets for requests per minute and tokens per minute.

A bucket holds up to `limit` units and refills at `limit / 60` per second. A request is admitted
when the bucket holds its cost (or, for a cost above the whole limit, when the bucket is full), so
one large request is never refused forever; the bucket may then go negative and the key waits.
Token costs are estimated at admission (prompt + max_tokens) and corrected when the engine reports
usage. The clock is injected, so tests need no sleeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    limit_per_minute: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        rate = self.limit_per_minute / 60.0
        self.level = min(self.limit_per_minute, self.level + (now - self.updated) * rate)
        self.updated = now

    def wait_s(self, cost: float) -> float:
        """Seconds until the bucket can admit `cost` (0 if it can now)."""
        need = min(cost, self.limit_per_minute) - self.level
        return 0.0 if need <= 0 else need * 60.0 / self.limit_per_minute


class RateLimiter:
    def __init__(self, requests_per_minute: int, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self.clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def _bucket(self, key: str, kind: str, limit: int, now: float) -> TokenBucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[(key, kind)] = TokenBucket(float(limit), float(limit), now)
        bucket.refill(now)
        return bucket

    def admit(self, key: str, estimated_tokens: int) -> tuple[str, int] | None:
        """None when admitted (both buckets charged); else (the limit hit, Retry-After seconds)."""
        now = self.clock()
        checks = []
        if self.rpm:
            checks.append(("requests", self._bucket(key, "requests", self.rpm, now), 1))
        if self.tpm:
            checks.append(("tokens", self._bucket(key, "tokens", self.tpm, now), estimated_tokens))
        for kind, bucket, cost in checks:
            wait = bucket.wait_s(cost)
            if wait > 0:
                return kind, max(1, math.ceil(wait))
        for _, bucket, cost in checks:
            bucket.level -= cost
        return None

    def settle(self, key: str, estimated_tokens: int, actual_tokens: int) -> None:
        """The engine reported the real usage: give back (or charge) the difference."""
        if not self.tpm:
            return
        bucket = self._bucket(key, "tokens", self.tpm, self.clock())
        bucket.level = min(bucket.level + estimated_tokens - actual_tokens, bucket.limit_per_minute)


def estimate_tokens(body: dict) -> int:
    """Prompt tokens (exact for token ids, ~4 characters a token for text) plus the output budget."""
    prompt = 0
    value = body.get("prompt")
    if isinstance(value, str):
        prompt = len(value) // 4 + 1
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, int):
                prompt += 1
            elif isinstance(item, str):
                prompt += len(item) // 4 + 1
            elif isinstance(item, list):
                prompt += len(item)
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            prompt += len(content) // 4 + 4
        elif isinstance(content, list):
            prompt += sum(len(str(part.get("text", ""))) // 4 + 1 for part in content if isinstance(part, dict))
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    n = body.get("n") or 1
    if not isinstance(max_tokens, int) or not isinstance(n, int):
        return prompt + 16
    return prompt + max(max_tokens, 0) * max(n, 1)
