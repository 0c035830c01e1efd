"""`lockstep bench serve`: load-test any OpenAI-compatible server, as `vllm bench serve` does.

Each request goes to /v1/completions with the prompt as token ids, `max_tokens` = its output
length, `ignore_eos`, greedy sampling, and a streamed usage chunk. Metrics follow vLLM's
definitions so numbers compare across tools:
* TTFT: request sent -> first chunk with non-empty `choices`.
* ITL: the gap between successive such chunks; a chunk carrying k tokens is one sample.
* E2EL: request sent -> last such chunk.
* TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
* Output tokens: `usage.completion_tokens` when the server sends it, else counted from chunks.
JSON keys are vLLM's (`request_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...).

Standard library plus httpx only: no torch, no numpy, no web framework. The client costs about
80 us of CPU per streamed chunk (httpx/h11, measured on the 2-core dev machine), so one process
tops out near 10k chunks/s; past that its own queueing inflates TTFT and ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TextIO

import httpx

from lockstep_common.argparsing import ArgumentParser
from lockstep.bench.workload import (
    DEFAULT_MIN_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    WORKLOADS,
    WorkloadRequest,
    describe,
    make_workload,
    poisson_arrivals,
)

# Connecting should be quick even to a loaded server; a slow first token is the read timeout's job.
MAX_CONNECT_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_S = 600.0
# metric name in JSON keys -> heading in the printed table
_LATENCY_METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


class BenchmarkError(RuntimeError):
    """The benchmark cannot run at all (server unreachable, no model to name)."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything `lockstep bench serve` was asked to do, validated once."""

    base_url: str
    workload: str = "sharegpt-synth"
    num_prompts: int = 1000
    request_rate: float = math.inf
    max_concurrency: int | None = None
    model: str | None = None
    seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    api_key: str | None = None
    endpoint: str = "/v1/completions"
    result_json: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    metric_percentiles: tuple[float, ...] = (99.0,)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {list(WORKLOADS)}, got {self.workload!r}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 or inf, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.vocab_size <= DEFAULT_MIN_TOKEN_ID:
            raise ValueError(f"--vocab-size must be > {DEFAULT_MIN_TOKEN_ID}, got {self.vocab_size}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        validate_endpoint(self.endpoint)
        for p in self.metric_percentiles:
            if not 0 < p < 100:
                raise ValueError(f"--metric-percentiles must lie in (0, 100), got {p}")


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


def validate_endpoint(endpoint: str) -> None:
    if not endpoint.startswith("/") or not endpoint.endswith("/completions"):
        raise ValueError(f"--endpoint must be a path ending in /completions, got {endpoint!r}")
    if endpoint.endswith("/chat/completions"):
        raise ValueError("--endpoint: chat completions cannot take token-id prompts; use /v1/completions")


def join_url(base_url: str, path: str) -> str:
    """base + path, accepting a base URL that already ends in /v1 (as OpenAI clients take it)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + path


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---------------------------------------------------------------------------------------------
# Streaming client


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
        self.num_done += 1
        self.num_failed += not result.success
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


async def run_benchmark(
    base_url: str,
    requests: Sequence[WorkloadRequest],
    *,
    model: str | None = None,
    endpoint: str = "/v1/completions",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    metric_percentiles: Sequence[float] = (99.0,),
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Send `requests` at `request_rate` (Poisson; inf = all at once), at most `max_concurrency`
    in flight, and return vLLM-style metrics. A line of progress goes to `progress` each tenth.
    Raises BenchmarkError if the server is unreachable."""
    validate_endpoint(endpoint)
    headers = auth_headers(api_key)
    timeout = httpx.Timeout(connect=min(MAX_CONNECT_TIMEOUT_S, timeout_s), read=timeout_s, write=timeout_s, pool=None)
    # One connection per in-flight request: httpx's default pool of 100 would silently cap concurrency.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    # trust_env=False: a benchmark talks to the server directly, never through an HTTP(S)_PROXY.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await resolve_model(client, base_url, headers, model)
        url = join_url(base_url, endpoint)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        tracker = Progress(len(requests), progress)
        in_flight = max_in_flight = 0

        async def limited(request: WorkloadRequest) -> RequestResult:
            nonlocal in_flight, max_in_flight
            async with semaphore:
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                try:
                    result = await send_request(client, url, completion_payload(request, model), headers)
                finally:
                    in_flight -= 1
            tracker.update(result)
            return result

        offsets = itertools.accumulate(poisson_arrivals(len(requests), request_rate, seed))
        started_at = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets, strict=True):
            delay = started_at + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started_at

    result = calculate_metrics(results, duration, metric_percentiles)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "base_url": base_url,
        "endpoint": endpoint,
        "model_id": model,
        "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": 1.0,
        "max_concurrency": max_concurrency,
        "max_concurrent_requests": max_in_flight,
        **result,
    }


# ---------------------------------------------------------------------------------------------
# Metrics


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/percentiles of a latency list in seconds, as vLLM's `*_ms` keys (0 if empty)."""
    values_ms = [v * 1000 for v in values_s]
    summary = {
        f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else 0.0,
        f"median_{name}_ms": statistics.median(values_ms) if values_ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(values_ms) if values_ms else 0.0,
    }
    for p in percentiles:
        summary[f"{percentile_key(p)}_{name}_ms"] = percentile(values_ms, p)
    return summary


def calculate_metrics(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = (99.0,)
) -> dict[str, Any]:
    """Aggregate per-request results the way `vllm bench serve` does; failed requests count zero tokens."""
    completed = [r for r in results if r.success]
    ttfts = [r.ttft for r in completed]
    e2els = [r.latency for r in completed]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in completed if r.output_tokens > 1]
    itls = [gap for r in completed for gap in r.itl]
    total_input = sum(r.prompt_len for r in completed)
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    total_output = sum(output_lens)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(completed),
        "failed": len(results) - len(completed),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(summarize_ms(name, values, percentiles))
    metrics.update(
        {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": output_lens,
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "errors": [r.error for r in results],
        }
    )
    return metrics


def format_table(result: dict[str, Any], percentiles: Sequence[float] = (99.0,)) -> str:
    """The result as `vllm bench serve` prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", float(result["duration"]))
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", float(result["request_throughput"]))
    row("Output token throughput (tok/s):", float(result["output_throughput"]))
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", float(result["total_token_throughput"]))
    for name, (short, heading) in _LATENCY_METRICS.items():
        lines.append("{s:{c}^{n}}".format(s=heading, n=50, c="-"))
        row(f"Mean {short} (ms):", float(result[f"mean_{name}_ms"]))
        row(f"Median {short} (ms):", float(result[f"median_{name}_ms"]))
        for p in percentiles:
            row(f"P{percentile_key(p)[1:]} {short} (ms):", float(result[f"{percentile_key(p)}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(errors: Sequence[str], limit: int = 5) -> str:
    """The most common request errors, with counts, most frequent first."""
    counts = Counter(e for e in errors if e)
    lines = [f"{count} x {error}" for error, count in counts.most_common(limit)]
    if len(counts) > limit:
        lines.append(f"... and {len(counts) - limit} other distinct errors")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="lockstep bench serve",
        description="Load-test an OpenAI-compatible server with a synthetic workload (like vllm bench serve).",
    )
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", default="sharegpt-synth", choices=WORKLOADS)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests/s, Poisson arrivals; inf sends all at once"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="prompt token ids lie below this")
    parser.add_argument("--api-key", default=None, help="bearer token (default: env OPENAI_API_KEY)")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--result-json", default=None, help="write the full result as JSON to this path")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a response may stay silent (read timeout)"
    )
    parser.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles to report, e.g. 50,90,99"
    )
    return parser


def parse_config(argv: Sequence[str]) -> ServeBenchConfig:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
        return ServeBenchConfig(
            base_url=args.base_url,
            workload=args.workload,
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            model=args.model,
            seed=args.seed,
            vocab_size=args.vocab_size,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
            endpoint=args.endpoint,
            result_json=args.result_json,
            timeout_s=args.timeout,
            metric_percentiles=percentiles,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _raise_open_file_limit() -> None:
    """At rate inf every request holds a socket at once; lift the soft fd limit to the hard one."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str]) -> int:
    config = parse_config(argv)
    requests = make_workload(config.workload, config.num_prompts, config.seed, config.vocab_size)
    stats = describe(requests)
    print(
        f"bench serve: {config.workload}, {stats['num_requests']} requests, mean prompt "
        f"{stats['mean_prompt_len']:.1f} / output {stats['mean_output_len']:.1f} tokens, "
        f"request rate {config.request_rate}, max concurrency {config.max_concurrency}",
        file=sys.stderr,
    )
    _raise_open_file_limit()
    try:
        result = asyncio.run(
            run_benchmark(
                config.base_url,
                requests,
                model=config.model,
                endpoint=config.endpoint,
                request_rate=config.request_rate,
                max_concurrency=config.max_concurrency,
                api_key=config.api_key,
                seed=config.seed,
                timeout_s=config.timeout_s,
                metric_percentiles=config.metric_percentiles,
                progress=sys.stderr,
            )
        )
    except BenchmarkError as exc:
        print(f"lockstep bench serve: error: {exc}", file=sys.stderr)
        return 1
    result.update({"workload": config.workload, "seed": config.seed, "workload_stats": stats})
    print(format_table(result, config.metric_percentiles))
    if result["failed"]:
        print(f"{result['failed']} requests failed:\n{format_errors(result['errors'])}", file=sys.stderr)
    if config.result_json:
        with open(config.result_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"bench serve: result written to {config.result_json}", file=sys.stderr)
    return 0 if result["completed"] else 1
