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

`--lora-modules A B ...` (vLLM's option) sends request i with `model` = the (i mod k)-th name, so
the requests spread evenly and the same way every run (vLLM's benchmark picks one at random per
request); the result says how many requests each adapter got and how many completed.

Standard library plus httpx only: no torch, no numpy, no web framework. The client costs about
80 us of CPU per streamed chunk (httpx/h11, measured on the 2-core dev machine), so one process
tops out near 10k chunks/s; past that its own queueing inflates TTFT and ITL. `--num-client-processes K`
spreads the requests over K spawned client processes that start at one common instant; the parent
merges their raw per-request results and computes the metrics over the union.

This module holds the command and the run; serve_client the streaming client, serve_processes the
client processes, serve_report the metrics and the printed table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from lockstep_common.argparsing import ArgumentParser
from lockstep.bench.serve_client import (
    DEFAULT_TIMEOUT_S,
    BenchmarkError,
    Progress,
    auth_headers,
    join_url,
    make_client,
    resolve_model,
    send_on_schedule,
)
from lockstep.bench.serve_processes import ClientPlan, run_client_processes
from lockstep.bench.serve_report import calculate_metrics, format_errors, format_table
from lockstep.bench.workload import (
    DEFAULT_MIN_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    WORKLOADS,
    WorkloadRequest,
    describe,
    make_workload,
    poisson_arrivals,
)


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
    num_client_processes: int = 1
    lora_modules: tuple[str, ...] = ()

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
        validate_num_client_processes(self.num_client_processes, self.max_concurrency)
        validate_lora_modules(self.lora_modules)
        for p in self.metric_percentiles:
            if not 0 < p < 100:
                raise ValueError(f"--metric-percentiles must lie in (0, 100), got {p}")


def validate_endpoint(endpoint: str) -> None:
    if not endpoint.startswith("/") or not endpoint.endswith("/completions"):
        raise ValueError(f"--endpoint must be a path ending in /completions, got {endpoint!r}")
    if endpoint.endswith("/chat/completions"):
        raise ValueError("--endpoint: chat completions cannot take token-id prompts; use /v1/completions")


def validate_num_client_processes(num_client_processes: int, max_concurrency: int | None) -> None:
    if num_client_processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {num_client_processes}")
    # Each process gets a share of --max-concurrency; a share of 0 could never send.
    if max_concurrency is not None and num_client_processes > max_concurrency:
        raise ValueError(
            f"--num-client-processes must be <= --max-concurrency ({max_concurrency}), got {num_client_processes}"
        )


def validate_lora_modules(names: Sequence[str]) -> None:
    for name in names:
        if not name or name != name.strip():
            raise ValueError(f"--lora-modules: an adapter name must be non-empty, unpadded; got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: each adapter once, got {list(names)}")


def request_models(model: str, lora_modules: Sequence[str], num_requests: int) -> list[str]:
    """The model each request names: request i the (i mod k)-th adapter, or `model` for all when none."""
    if not lora_modules:
        return [model] * num_requests
    return [lora_modules[i % len(lora_modules)] for i in range(num_requests)]


def lora_counts(lora_modules: Sequence[str], models: Sequence[str], results: Sequence[Any]) -> dict[str, Any]:
    """The result's LoRA keys (none without adapters): the adapters named, and per adapter the requests
    sent and completed."""
    if not lora_modules:
        return {}
    sent = dict.fromkeys(lora_modules, 0)
    completed = dict.fromkeys(lora_modules, 0)
    for model, result in zip(models, results, strict=True):
        sent[model] += 1
        completed[model] += result.success
    return {"lora_modules": list(lora_modules), "lora_requests": sent, "lora_completed": completed}


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
    num_client_processes: int = 1,
    lora_modules: Sequence[str] = (),
) -> dict[str, Any]:
    """Send `requests` at `request_rate` (Poisson; inf = all at once), at most `max_concurrency`
    in flight, and return vLLM-style metrics. A line of progress goes to `progress` each tenth.
    With `num_client_processes` > 1 the requests are spread over that many spawned processes.
    With `lora_modules`, request i names adapter i mod k instead of the model.
    Raises BenchmarkError if the server is unreachable or a client process fails."""
    validate_endpoint(endpoint)
    validate_num_client_processes(num_client_processes, max_concurrency)
    validate_lora_modules(lora_modules)
    headers = auth_headers(api_key)
    offsets = list(itertools.accumulate(poisson_arrivals(len(requests), request_rate, seed)))
    if num_client_processes == 1:
        async with make_client(timeout_s, max_concurrency) as client:
            model = await resolve_model(client, base_url, headers, model)
            models = request_models(model, lora_modules, len(requests))
            tracker = Progress(len(requests), progress)
            started_at = time.perf_counter()
            results, _, max_in_flight = await send_on_schedule(
                client, join_url(base_url, endpoint), headers, models, requests, offsets, started_at,
                max_concurrency, tracker.update,
            )  # fmt: skip
            duration = time.perf_counter() - started_at
    else:
        # The parent checks the server once and names the model for all the processes.
        async with make_client(timeout_s, None) as client:
            model = await resolve_model(client, base_url, headers, model)
        models = request_models(model, lora_modules, len(requests))
        # The processes are waited on with blocking calls; a thread keeps this event loop free.
        results, duration, max_in_flight = await asyncio.to_thread(
            run_client_processes,
            ClientPlan(url=join_url(base_url, endpoint), headers=headers, model=model, timeout_s=timeout_s, models=models),
            requests, offsets, num_client_processes, max_concurrency, progress,
        )  # fmt: skip

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
        "num_client_processes": num_client_processes,
        **lora_counts(lora_modules, models, results),
        **result,
    }


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
    parser.add_argument(
        "--num-client-processes",
        type=int,
        default=1,
        help="client processes to spread the load over (one tops out near 10k streamed chunks/s): the same "
        "requests and arrival times, request i sent by process i %% K from a common start; --max-concurrency "
        "is split evenly, each process getting the ceiling or the floor of max/K",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapters (names the server serves) to spread the requests over: request i names adapter "
        "i %% k as its model, so each gets an even share; the result counts requests per adapter",
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
            num_client_processes=args.num_client_processes,
            lora_modules=tuple(args.lora_modules or ()),
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
        f"request rate {config.request_rate}, max concurrency {config.max_concurrency}"
        + (f", {config.num_client_processes} client processes" if config.num_client_processes > 1 else "")
        + (f", LoRA adapters {' '.join(config.lora_modules)}" if config.lora_modules else ""),
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
                num_client_processes=config.num_client_processes,
                lora_modules=config.lora_modules,
            )
        )
    except BenchmarkError as exc:
        print(f"lockstep bench serve: error: {exc}", file=sys.stderr)
        return 1
    result.update({"workload": config.workload, "seed": config.seed, "workload_stats": stats})
    print(format_table(result, config.metric_percentiles))
    if config.lora_modules:
        print("LoRA adapters (requests completed/sent): " + ", ".join(
            f"{name} {result['lora_completed'][name]}/{sent}" for name, sent in result["lora_requests"].items()
        ))  # fmt: skip
    if result["failed"]:
        print(f"{result['failed']} requests failed:\n{format_errors(result['errors'])}", file=sys.stderr)
    if config.result_json:
        with open(config.result_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"bench serve: result written to {config.result_json}", file=sys.stderr)
    return 0 if result["completed"] else 1
