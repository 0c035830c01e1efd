"""`lockstep bench serve`'s streaming client: one request streamed and timed chunk by chunk, and a
workload sent on its arrival schedule with at most `max_concurrency` requests in flight.

The client costs about 80 us of CPU per streamed chunk (httpx/h11, measured on the 2-core dev
machine), so one process tops out near 10k chunks/s (serve_processes spreads the load past that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from lockstep.bench.workload import WorkloadRequest

# Connecting should be quick even to a loaded server; a slow first token is the read timeout's job.
MAX_CONNECT_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_S = 600.0


class BenchmarkError(RuntimeError):
    """The benchmark cannot run at all (server unreachable, no model to name)."""


@dataclass
class RequestResult:
    """What one request measured; times in seconds from the request's own start."""

    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0


def join_url(base_url: str, path: str) -> str:
    """base + path, accepting a base URL that already ends in /v1 (as OpenAI clients take it)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + path


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, other fields and blank lines."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :]
    return data[1:] if data.startswith(" ") else data


def chunk_token_count(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice carries: from token ids or logprobs when sent, else one."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1


def error_message(body: str) -> str:
    """The message out of an OpenAI error body (or vLLM's older flat one), else the raw text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
    return body.strip()[:300]


def completion_payload(request: WorkloadRequest, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str]
) -> RequestResult:
    """Stream one completion and time its chunks. Never raises for a request's own failure."""
    result = RequestResult(prompt_len=len(payload["prompt"]))
    start = last_chunk_at = time.perf_counter()
    result.start_time = start
    num_chunk_tokens = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {error_message(body)}"
                return result
            async for line in response.aiter_lines():
                now = time.perf_counter()
                data = sse_data(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {error_message(data)}"
                    return result
                if choices := chunk.get("choices"):
                    if num_chunk_tokens == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last_chunk_at)
                    last_chunk_at = now
                    num_chunk_tokens += chunk_token_count(choices[0])
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = int(usage["prompt_tokens"])
    except httpx.TimeoutException as exc:
        result.error = f"timeout ({type(exc).__name__}) after {time.perf_counter() - start:.1f} s"
        return result
    # One request's failure of any kind (transport, malformed chunk) is that request's error; the
    # benchmark goes on and counts it.
    except Exception as exc:  # noqa: BLE001
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if num_chunk_tokens == 0:
        result.error = "stream ended without a content chunk (no first token)"
        return result
    result.success = True
    result.latency = last_chunk_at - start
    result.output_tokens = usage_tokens if usage_tokens is not None else num_chunk_tokens
    return result


async def resolve_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str], model: str | None) -> str:
    """Check the server answers, and name the model: the given one, else the first it lists."""
    url = join_url(base_url, "/v1/models")
    try:
        response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise BenchmarkError(f"cannot reach server at {url}: {type(exc).__name__}: {exc}") from exc
    if model is not None:
        return model
    if response.status_code != 200:
        raise BenchmarkError(
            f"GET {url} returned HTTP {response.status_code}: {error_message(response.text)}; "
            "pass --model to name the model"
        )
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchmarkError(f"GET {url} listed no model ({response.text[:200]!r}); pass --model") from exc


class Progress:
    """A line on a stream each time another tenth of the requests has finished."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = total
        self.stream = stream
        self.num_done = 0
        self.num_failed = 0
        self.started_at = time.perf_counter()
        self._next_tenth = 1

    def update(self, result: RequestResult) -> None:
        self.record(result.success)

    def record(self, success: bool) -> None:
        self.num_done += 1
        self.num_failed += not success
        if self.stream is None or self.num_done * 10 < self._next_tenth * self.total:
            return
        while self.num_done * 10 >= self._next_tenth * self.total:
            self._next_tenth += 1
        elapsed = time.perf_counter() - self.started_at
        print(
            f"bench serve: {self.num_done}/{self.total} requests done "
            f"({100 * self.num_done // self.total}%), {self.num_failed} failed, {elapsed:.1f} s",
            file=self.stream,
            flush=True,
        )


def make_client(timeout_s: float, max_concurrency: int | None) -> httpx.AsyncClient:
    timeout = httpx.Timeout(connect=min(MAX_CONNECT_TIMEOUT_S, timeout_s), read=timeout_s, write=timeout_s, pool=None)
    # One connection per in-flight request: httpx's default pool of 100 would silently cap concurrency.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    # trust_env=False: a benchmark talks to the server directly, never through an HTTP(S)_PROXY.
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def send_on_schedule(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    models: Sequence[str],
    requests: Sequence[WorkloadRequest],
    offsets: Sequence[float],
    started_at: float,
    max_concurrency: int | None,
    on_done: Callable[[RequestResult], None],
) -> tuple[list[RequestResult], list[float], int]:
    """Send each request at `started_at` (perf_counter clock) + its offset, naming the model of the
    same index in `models`, at most `max_concurrency` in flight. Returns the results in request order, each one's perf_counter finish time, and the
    most requests that were in flight at once."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = max_in_flight = 0

    async def limited(request: WorkloadRequest, model: str) -> tuple[RequestResult, float]:
        nonlocal in_flight, max_in_flight
        async with semaphore:
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                result = await send_request(client, url, completion_payload(request, model), headers)
            finally:
                in_flight -= 1
            finished_at = time.perf_counter()
        on_done(result)
        return result, finished_at

    tasks = []
    for request, offset, model in zip(requests, offsets, models, strict=True):
        delay = started_at + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(request, model)))
    done = await asyncio.gather(*tasks)
    return [result for result, _ in done], [finished_at for _, finished_at in done], max_in_flight
