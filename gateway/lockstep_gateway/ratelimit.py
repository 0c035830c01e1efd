"""Per-key rate limits: token buckets for requests per minute and tokens per minute.

A bucket holds up to `limit` units and refills at `limit / 60` per second. A request is admitted
when the bucket holds its cost (or, for a cost above the whole limit, when the bucket is full), so
one large request is never refused forever; the bucket may then go negative and the key waits.
Token costs are estimated at admission, (prompt + min(max_tokens, what the context leaves)) per
prompt, times `n`, and corrected when the engine reports usage; a request that gets no 2xx answer
is refunded whole (request and tokens), so a refused request costs nothing. The clock is injected,
so tests need no sleeps.

Without API keys the bucket is per client address: the TCP peer, or, when the peer is one of the
configured trusted proxies, the nearest untrusted address of its `X-Forwarded-For` chain.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from lockstep_common.max_tokens import requested_max_tokens


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

    def refund(self, key: str, estimated_tokens: int) -> None:
        """The request was refused or failed: it costs nothing."""
        now = self.clock()
        if self.rpm:
            bucket = self._bucket(key, "requests", self.rpm, now)
            bucket.level = min(bucket.level + 1, bucket.limit_per_minute)
        if self.tpm:
            bucket = self._bucket(key, "tokens", self.tpm, now)
            bucket.level = min(bucket.level + estimated_tokens, bucket.limit_per_minute)


# Far above any real request, and small enough that bucket arithmetic in floats stays exact.
MAX_ESTIMATE = 1 << 50
DEFAULT_MAX_TOKENS = 16  # vLLM's default for completions


def _text_tokens(text: str) -> int:
    return len(text) // 4 + 1  # ~4 characters a token


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_lengths(body: dict) -> list[int]:
    """Estimated prompt tokens of each prompt in the request (exact for token ids). Values of the
    wrong type count as nothing here: the engine refuses them with a 400 (which is refunded)."""
    value = body.get("prompt")
    if isinstance(value, str):
        return [_text_tokens(value)]
    if isinstance(value, list) and value:
        if all(_is_int(item) for item in value):
            return [len(value)]  # one prompt of token ids
        lengths = []
        for item in value:
            if isinstance(item, str):
                lengths.append(_text_tokens(item))
            elif isinstance(item, list):
                lengths.append(len(item))
        return lengths or [1]
    messages = body.get("messages")
    if isinstance(body.get("input"), str):  # /v1/responses
        return [_text_tokens(body["input"]) + 3]
    if isinstance(body.get("input"), list):
        messages = body["input"]
    if isinstance(messages, list):
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += _text_tokens(content) + 3
            elif isinstance(content, list):
                total += sum(_text_tokens(str(part.get("text", ""))) for part in content if isinstance(part, dict))
        return [total or 1]
    return [1]


def estimate_tokens(body: dict, max_model_len: int | None = None) -> int:
    """(prompt + min(max_tokens, what the context leaves)) per prompt, times `n`."""
    max_tokens = requested_max_tokens(body)
    if not _is_int(max_tokens):
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None or max_model_len is None else max_model_len
    n = body.get("n")
    n = n if _is_int(n) and n >= 1 else 1
    total = 0
    for prompt in prompt_lengths(body):
        output = max(max_tokens, 0)
        if max_model_len is not None:
            output = min(output, max(max_model_len - prompt, 0))
        total += prompt + output
    return min(total * n, MAX_ESTIMATE)


class ClientAddress:
    """Who a request comes from, for limits without keys: `X-Forwarded-For` is believed only from
    trusted proxies (an ingress), or anyone could pick their own bucket."""

    def __init__(self, trusted: tuple[str, ...]):
        self.trusted = [ipaddress.ip_network(t, strict=False) for t in trusted]

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.strip().strip("[]"))
        except ValueError:
            return False
        return any(ip in network for network in self.trusted)

    def of(self, peer: str | None, forwarded_for: str | None) -> str:
        if peer is None:
            return "unknown"
        if not self.trusted or not forwarded_for or not self._is_trusted(peer):
            return peer
        # Each proxy appends the address it saw: the nearest untrusted one is the client.
        for hop in reversed([h.strip() for h in forwarded_for.split(",") if h.strip()]):
            if not self._is_trusted(hop):
                return hop
        return peer
