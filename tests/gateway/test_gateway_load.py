"""Acceptance: many concurrent streams through the gateway over two real engines."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from gateway_harness import MODEL, wait_for

NUM_STREAMS = 200


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, str | None]:
    """(number of token events, finish_reason) of one streamed completion."""
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events, finish = 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            events += 1
            finish = event["choices"][0]["finish_reason"] or finish
    return events, finish


def test_200_concurrent_streams_over_two_engines_all_complete_evenly_shared(engines, start_gateway):
    gateway = start_gateway(*[f"--engine={e.url}" for e in engines], expect_healthy={e.url for e in engines})
    before = {e.url: gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok")
              for e in engines}

    async def run():
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*[_stream(client, gateway.url, 8) for _ in range(NUM_STREAMS)])

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    assert all(finish == "length" for _, finish in results)
    assert all(events >= 1 for events, _ in results)

    def shares():
        return {e.url: gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok")
                - before[e.url] for e in engines}

    # A stream is counted when the gateway's relay finishes, just after the client read [DONE].
    wait_for("every stream counted", lambda: sum(shares().values()) == NUM_STREAMS, timeout=10)
    counts = shares()
    print(f"{NUM_STREAMS} streams in {elapsed:.1f}s, per engine: {counts}")
    for count in counts.values():
        assert abs(count - NUM_STREAMS / 2) <= 0.2 * NUM_STREAMS / 2, counts
