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
tops out near 10k chunks/s; past that its own queueing inflates TTFT and ITL. `--num-client-processes K`
spreads the requests over K spawned client processes that start at one common instant; the parent
merges their raw per-request results and computes the metrics over the union.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.connection import Connection, wait
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
# Client processes: spawning one and importing httpx takes about a second; a loaded machine, more.
PROCESS_STARTUP_TIMEOUT_S = 60.0
# How far in the future the common start instant lies once every process is ready: time to read it.
PROCESS_START_LEAD_S = 0.2
# A running client process says it is alive this often, so a hung one is told from a long stream.
PROCESS_HEARTBEAT_S = 1.0
# A client process silent this long (no heartbeat, completion or result) is taken as hung.
PROCESS_SILENCE_TIMEOUT_S = 30.0
# How long a process that has sent its results, or was told to stop, may take to exit.
PROCESS_EXIT_TIMEOUT_S = 10.0


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
    num_client_processes: int = 1

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


def validate_num_client_processes(num_client_processes: int, max_concurrency: int | None) -> None:
    if num_client_processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {num_client_processes}")
    # Each process gets a share of --max-concurrency; a share of 0 could never send.
    if max_concurrency is not None and num_client_processes > max_concurrency:
        raise ValueError(
            f"--num-client-processes must be <= --max-concurrency ({max_concurrency}), got {num_client_processes}"
        )


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
    model: str,
    requests: Sequence[WorkloadRequest],
    offsets: Sequence[float],
    started_at: float,
    max_concurrency: int | None,
    on_done: Callable[[RequestResult], None],
) -> tuple[list[RequestResult], list[float], int]:
    """Send each request at `started_at` (perf_counter clock) + its offset, at most `max_concurrency`
    in flight. Returns the results in request order, each one's perf_counter finish time, and the
    most requests that were in flight at once."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = max_in_flight = 0

    async def limited(request: WorkloadRequest) -> tuple[RequestResult, float]:
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
    for request, offset in zip(requests, offsets, strict=True):
        delay = started_at + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(request)))
    done = await asyncio.gather(*tasks)
    return [result for result, _ in done], [finished_at for _, finished_at in done], max_in_flight


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
) -> dict[str, Any]:
    """Send `requests` at `request_rate` (Poisson; inf = all at once), at most `max_concurrency`
    in flight, and return vLLM-style metrics. A line of progress goes to `progress` each tenth.
    With `num_client_processes` > 1 the requests are spread over that many spawned processes.
    Raises BenchmarkError if the server is unreachable or a client process fails."""
    validate_endpoint(endpoint)
    validate_num_client_processes(num_client_processes, max_concurrency)
    headers = auth_headers(api_key)
    offsets = list(itertools.accumulate(poisson_arrivals(len(requests), request_rate, seed)))
    if num_client_processes == 1:
        async with make_client(timeout_s, max_concurrency) as client:
            model = await resolve_model(client, base_url, headers, model)
            tracker = Progress(len(requests), progress)
            started_at = time.perf_counter()
            results, _, max_in_flight = await send_on_schedule(
                client, join_url(base_url, endpoint), headers, model, requests, offsets, started_at,
                max_concurrency, tracker.update,
            )  # fmt: skip
            duration = time.perf_counter() - started_at
    else:
        # The parent checks the server once and names the model for all the processes.
        async with make_client(timeout_s, None) as client:
            model = await resolve_model(client, base_url, headers, model)
        # The processes are waited on with blocking calls; a thread keeps this event loop free.
        results, duration, max_in_flight = await asyncio.to_thread(
            run_client_processes,
            ClientPlan(url=join_url(base_url, endpoint), headers=headers, model=model, timeout_s=timeout_s),
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
        **result,
    }


# ---------------------------------------------------------------------------------------------
# Several client processes


@dataclass
class ClientPlan:
    """What one client process sends: its requests (by index in the whole workload) and their offsets."""

    url: str
    headers: dict[str, str]
    model: str
    timeout_s: float
    process_index: int = 0
    max_concurrency: int | None = None
    indices: list[int] = field(default_factory=list)
    requests: list[WorkloadRequest] = field(default_factory=list)
    offsets: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TimedResult:
    """One request's result from a client process, with absolute (time.time()) send and finish times."""

    index: int
    result: RequestResult
    sent_at: float
    finished_at: float


def concurrency_shares(max_concurrency: int | None, num_processes: int) -> list[int | None]:
    """--max-concurrency split as evenly as it goes: the first (max % K) processes get one more."""
    if max_concurrency is None:
        return [None] * num_processes
    base, extra = divmod(max_concurrency, num_processes)
    return [base + (j < extra) for j in range(num_processes)]


def max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """The most (start, end) intervals open at one instant; one ending as another starts is not overlap."""
    # At equal times the end (-1) sorts before the start (+1).
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


def client_process_main(conn: Connection, plan: ClientPlan) -> None:
    """A client process: say ready, wait for the common start instant, send the plan's requests at
    their offsets (reporting each completion), then send back the results, or the error."""
    try:
        conn.send(("ready",))
        # The parent sends the start once every process is ready, or stops them all.
        if not conn.poll(2 * PROCESS_STARTUP_TIMEOUT_S):
            raise BenchmarkError(f"no start instant from the parent within {2 * PROCESS_STARTUP_TIMEOUT_S:.0f} s")
        _, start_at = conn.recv()
        results = asyncio.run(_client_process_run(conn, plan, start_at))
        conn.send(("results", results))
    except KeyboardInterrupt:
        sys.exit(1)
    # Anything that stops this process is the run's failure; the parent names it.
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        with contextlib.suppress(OSError, EOFError, ValueError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    finally:
        conn.close()


async def _client_process_run(conn: Connection, plan: ClientPlan, start_at: float) -> list[TimedResult]:
    # perf_counter times the requests; time.time() is the clock the processes share.
    wall_minus_perf = time.time() - time.perf_counter()

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(PROCESS_HEARTBEAT_S)
            conn.send(("alive",))

    async with make_client(plan.timeout_s, plan.max_concurrency) as client:
        beating = asyncio.create_task(heartbeat())
        try:
            results, finished, _ = await send_on_schedule(
                client, plan.url, plan.headers, plan.model, plan.requests, plan.offsets,
                start_at - wall_minus_perf, plan.max_concurrency, lambda r: conn.send(("done", r.success)),
            )  # fmt: skip
        finally:
            beating.cancel()
    return [
        TimedResult(index, result, result.start_time + wall_minus_perf, end + wall_minus_perf)
        for index, result, end in zip(plan.indices, results, finished, strict=True)
    ]


class ClientProcesses:
    """The parent's side of the client processes: one duplex pipe each, every wait bounded."""

    def __init__(self, plans: Sequence[ClientPlan]) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        # when each process was last heard from, reset by each receive()
        self.last_heard: list[float] = []
        try:
            for plan in plans:
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=client_process_main, args=(child_end, plan), name=f"bench-serve-client-{plan.process_index}"
                )
                # daemon: a parent that dies takes its client processes with it
                process.daemon = True
                process.start()
                # Only the child holds its end now, so its death reads as end-of-file here.
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
        except BaseException:
            self.stop()
            raise

    def name(self, j: int) -> str:
        return f"client process {j} of {len(self.processes)} (pid {self.processes[j].pid})"

    def receive(
        self, waiting: set[int], handle: Callable[[int, tuple], bool], silence_s: float, waiting_for: str
    ) -> None:
        """Pass each message to `handle(j, message)` until it has returned True for every process in
        `waiting`. Raises BenchmarkError for a process that fails, exits first or is silent `silence_s`."""
        now = time.monotonic()
        self.last_heard = [now] * len(self.processes)
        while waiting:
            wait([self.conns[j] for j in waiting] + [self.processes[j].sentinel for j in waiting], timeout=1.0)
            for j in sorted(waiting):
                conn = self.conns[j]
                try:
                    while j in waiting and conn.poll():
                        message = conn.recv()
                        self.last_heard[j] = time.monotonic()
                        if message[0] == "error":
                            raise BenchmarkError(f"{self.name(j)} failed: {message[1]}")
                        if handle(j, message):
                            waiting.discard(j)
                except (EOFError, OSError):
                    # Its end of the pipe closed before the message awaited: it is exiting.
                    self.processes[j].join(PROCESS_EXIT_TIMEOUT_S)
                    raise BenchmarkError(self._exited(j, waiting_for)) from None
                if j not in waiting:
                    continue
                if not self.processes[j].is_alive():
                    raise BenchmarkError(self._exited(j, waiting_for))
                if time.monotonic() - self.last_heard[j] > silence_s:
                    raise BenchmarkError(f"{self.name(j)} sent nothing for {silence_s:.0f} s, {waiting_for}")

    def _exited(self, j: int, waiting_for: str) -> str:
        code = self.processes[j].exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {_signal_name(-code)}"
        else:
            how = f"exited with code {code}"
        return f"{self.name(j)} {how}, {waiting_for}"

    def send_all(self, message: tuple) -> None:
        for j, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except OSError:
                raise BenchmarkError(self._exited(j, "before the start instant reached it")) from None

    def stop(self, exit_s: float = 0.0) -> None:
        """Give the processes `exit_s` seconds to exit by themselves, then terminate (or kill) the rest."""
        deadline = time.monotonic() + exit_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(PROCESS_EXIT_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(PROCESS_EXIT_TIMEOUT_S)
        for conn in self.conns:
            conn.close()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def run_client_processes(
    template: ClientPlan,
    requests: Sequence[WorkloadRequest],
    offsets: Sequence[float],
    num_processes: int,
    max_concurrency: int | None,
    progress: TextIO | None,
) -> tuple[list[RequestResult], float, int]:
    """Send request i from process i % num_processes at its offset from a common start instant.
    Returns the results in request order, the duration (last finish - start) and the most in flight."""
    plans = []
    for j, share in enumerate(concurrency_shares(max_concurrency, num_processes)):
        indices = list(range(j, len(requests), num_processes))
        plans.append(
            ClientPlan(
                url=template.url, headers=template.headers, model=template.model, timeout_s=template.timeout_s,
                process_index=j, max_concurrency=share, indices=indices,
                requests=[requests[i] for i in indices], offsets=[offsets[i] for i in indices],
            )
        )  # fmt: skip
    timed: dict[int, TimedResult] = {}
    tracker = Progress(len(requests), progress)

    def on_message(j: int, message: tuple) -> bool:
        """True once process j has sent what is awaited of it: "ready", then "results"."""
        kind = message[0]
        if kind == "done":
            tracker.record(message[1])
        elif kind == "results":
            timed.update((t.index, t) for t in message[1])
        return kind in ("ready", "results")

    processes = ClientProcesses(plans)
    try:
        processes.receive(set(range(num_processes)), on_message, PROCESS_STARTUP_TIMEOUT_S, "before it was ready")
        start_at = time.time() + PROCESS_START_LEAD_S
        tracker.started_at = time.perf_counter() + PROCESS_START_LEAD_S
        processes.send_all(("start", start_at))
        processes.receive(
            set(range(num_processes)), on_message, PROCESS_SILENCE_TIMEOUT_S, "before it returned its results"
        )
    except BaseException:
        processes.stop()
        raise
    # Each has sent its results and is exiting; one that lingers is stopped, its results kept.
    processes.stop(PROCESS_EXIT_TIMEOUT_S)
    if len(timed) != len(requests):
        raise BenchmarkError(f"the client processes returned {len(timed)} results for {len(requests)} requests")
    ordered = [timed[i] for i in range(len(requests))]
    duration = max((t.finished_at for t in ordered), default=start_at) - start_at
    max_in_flight = max_overlap([(t.sent_at, t.finished_at) for t in ordered])
    return [t.result for t in ordered], duration, max_in_flight


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
    parser.add_argument(
        "--num-client-processes",
        type=int,
        default=1,
        help="client processes to spread the load over (one tops out near 10k streamed chunks/s): the same "
        "requests and arrival times, request i sent by process i %% K from a common start; --max-concurrency "
        "is split evenly, each process getting the ceiling or the floor of max/K",
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
        + (f", {config.num_client_processes} client processes" if config.num_client_processes > 1 else ""),
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
