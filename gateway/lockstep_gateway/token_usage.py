"""Token accounting: a request is charged its estimated tokens at admission (`--rate-limit-tpm`); the usage
the engine reports corrects the charge once, from a plain answer's body or from the streamed event that
carries it."""

from __future__ import annotations

import json
from typing import Protocol

from lockstep_gateway.ratelimit import RateLimiter


class Job(Protocol):
    """What accounting reads and marks of a relayed request (proxy.Job has it)."""

    rate_key: str
    estimated_tokens: int
    settled: bool


def total_tokens(usage) -> int | None:
    """The tokens an OpenAI or Anthropic usage object counts; None when it counts none."""
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if total is None and isinstance(usage.get("input_tokens"), int) and isinstance(usage.get("output_tokens"), int):
        # /v1/messages: Anthropic's usage has no total; the prompt is input plus cache reads
        total = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + usage["output_tokens"]
    return total if isinstance(total, int) else None


def settle(limiter: RateLimiter, job: Job, usage) -> None:
    total = total_tokens(usage)
    if total is not None and not job.settled:
        job.settled = True
        limiter.settle(job.rate_key, job.estimated_tokens, total)


def settle_from_json(limiter: RateLimiter, job: Job, body: bytes) -> None:
    if limiter.tpm:
        try:
            settle(limiter, job, json.loads(body).get("usage"))
        except (ValueError, AttributeError):
            pass


def settle_from_sse(limiter: RateLimiter, job: Job, events: bytes) -> None:
    """From whole SSE events; Anthropic's message_start carries a usage too, before any output: not the last."""
    if not limiter.tpm:
        return
    for line in events.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line and b'"type":"message_start"' not in line:
            try:
                settle(limiter, job, json.loads(line[6:]).get("usage"))
            except (ValueError, AttributeError):
                pass
