"""A bounded client load for the chaos tests: C clients sending streamed and plain completions in
a loop until told to stop, every request recorded with when it started and ended and what the
client got. Nothing is retried by the client, so what it records is what the gateway did."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

MODEL = "random:tiny"


@dataclass
class Outcome:
    started: float
    stream: bool
    ended: float | None = None
    status: int | None = None
    tokens: int = 0
    finish: str | None = None
    error: dict | None = None  # the OpenAI-shaped error the client got (body or SSE event)

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.error is None and self.finish == "length"


@dataclass
class Load:
    url: str
    clients: int = 6
    max_tokens: int = 24
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _one(self, client: httpx.AsyncClient, stream: bool) -> None:
        outcome = Outcome(time.monotonic(), stream)
        self.outcomes.append(outcome)
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": stream}
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.error = json.loads(await response.aread())["error"]
                elif stream:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            outcome.error = event["error"]
                        else:
                            outcome.tokens += 1
                            outcome.finish = event["choices"][0]["finish_reason"] or outcome.finish
                else:
                    choice = json.loads(await response.aread())["choices"][0]
                    outcome.tokens, outcome.finish = self.max_tokens, choice["finish_reason"]
        except httpx.HTTPError as error:  # the gateway dropped the client: the worst outcome, asserted on
            outcome.error = {"code": "transport", "message": type(error).__name__}
        finally:
            outcome.ended = time.monotonic()

    async def _client(self, index: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            turn = index
            while not self.stop.is_set():
                turn += 1
                await self._one(client, stream=turn % 2 == 0)

    async def run(self) -> None:
        await asyncio.gather(*[self._client(i) for i in range(self.clients)])

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in self.outcomes:
            key = "complete" if o.complete else f"error {o.error['code'] if o.error else o.status}"
            counts[key] = counts.get(key, 0) + 1
        return counts
