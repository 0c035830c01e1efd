"""Prefix-aware routing against least-load, through a real gateway over several real engines.

Starts `--engines` engines (`lockstep serve MODEL`, small KV caches so one engine cannot hold the
whole working set) and, per routing policy, a `lockstep gateway` in front of them, then runs:

* `multi-turn`: `--conversations` chats at once, each on one of `--system-prompts` shared system
  prompts, `--turns` turns each; a turn's prompt is the whole conversation so far (system prompt,
  earlier user and assistant tokens) plus new user tokens;
* `sharegpt`: sharegpt-synth lengths (outputs capped at `--max-output`), as many requests as the
  multi-turn run, at the same concurrency, with no shared prefixes.

Prompts are token ids; each (policy, workload) run draws fresh ids, so no run hits blocks an
earlier one left in the caches. Reported per run: the engines' prefix-cache hit rate (the change of
lockstep_prefix_cache_hits_total / _queries_total summed over the engines: prompt tokens found in a
cache), TTFT p50/p99, requests/s and output tokens/s. Usage:

    python -m lockstep.bench.prefix_routing --engines 3 --conversations 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from lockstep.bench.gateway import free_port, stop
from lockstep.bench.serve_client import send_request
from lockstep.bench.serve_report import percentile
from lockstep.bench.workload import sample_lengths

POLICIES = ("least-load", "prefix-aware")
WORKLOADS = ("multi-turn", "sharegpt")
MIN_TOKEN_ID = 10  # below: the special tokens of the random models' vocabularies


def engine_command(model: str, port: int, args) -> list[str]:
    return [sys.executable, "-m", "lockstep.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
            "--max-model-len", "2048", *args.engine_arg]


def gateway_command(port: int, engines: Sequence[str], policy: str) -> list[str]:
    return [sys.executable, "-m", "lockstep.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--routing", policy, "--health-check-interval", "0.5", "--metrics-interval", "0.25",
            *[f"--engine={url}" for url in engines]]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, count_healthy: int | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            response = httpx.get(url + "/health", timeout=2)
            if response.status_code == 200 and (count_healthy is None
                                                or response.json().get("healthy_engines") == count_healthy):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout_s:g}s")


def prefix_counters(engines: Sequence[str]) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the engines."""
    hits = queries = 0.0
    for url in engines:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("lockstep_prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("lockstep_prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(n)]


def multi_turn_conversations(args, rng: random.Random) -> list[list[tuple[list[int], int]]]:
    """Per conversation its turns as (prompt token ids, output length)."""
    systems = [_tokens(rng, args.system_tokens, args.vocab) for _ in range(args.system_prompts)]
    conversations = []
    for c in range(args.conversations):
        history = list(systems[c % len(systems)])
        turns = []
        for _ in range(args.turns):
            history += _tokens(rng, args.user_tokens, args.vocab)
            turns.append((list(history), args.output_tokens))
            history += _tokens(rng, args.output_tokens, args.vocab)  # stands for the answer
        conversations.append(turns)
    return conversations


def sharegpt_conversations(args, rng: random.Random) -> list[list[tuple[list[int], int]]]:
    """The same number of requests, sharegpt-shaped, split over as many clients; nothing shared."""
    lengths = sample_lengths(args.conversations * args.turns, seed=rng.randrange(1 << 30))
    requests = [(_tokens(rng, min(p, 2048 - args.max_output), args.vocab), min(o, args.max_output))
                for p, o in lengths]
    return [requests[i::args.conversations] for i in range(args.conversations)]


async def run_workload(url: str, model: str, conversations) -> tuple[list, float]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(conversations))) as client:
        async def converse(turns):
            results = []
            for prompt, output in turns:
                payload = {"model": model, "prompt": prompt, "max_tokens": output, "ignore_eos": True,
                           "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
                results.append(await send_request(client, url + "/v1/completions", payload, {}))
            return results

        started = time.perf_counter()
        per_conversation = await asyncio.gather(*(converse(turns) for turns in conversations))
        return [r for results in per_conversation for r in results], time.perf_counter() - started


def measure(policy: str, workload: str, engines: Sequence[str], args, seed: int) -> dict:
    port = free_port()
    gateway = subprocess.Popen(gateway_command(port, engines, policy), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, gateway, 60, count_healthy=len(engines))
        rng = random.Random(seed)
        conversations = (multi_turn_conversations if workload == "multi-turn" else sharegpt_conversations)(args, rng)
        hits0, queries0 = prefix_counters(engines)
        results, duration = asyncio.run(run_workload(url, args.model, conversations))
        hits1, queries1 = prefix_counters(engines)
    finally:
        stop(gateway)
    ok = [r for r in results if r.success]
    ttfts = [r.ttft * 1000 for r in ok]
    return {"policy": policy, "workload": workload, "requests": len(results), "failed": len(results) - len(ok),
            "prefix_hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1.0),
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "request_throughput": len(ok) / duration,
            "output_throughput": sum(r.output_tokens for r in ok) / duration, "duration_s": duration}


def table(rows: list[dict]) -> str:
    lines = ["| workload | routing | requests (failed) | prefix-cache hit rate | TTFT p50 / p99 ms | req/s | out tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['policy']} | {r['requests']} ({r['failed']}) | "
                     f"{r['prefix_hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['request_throughput']:.2f} | {r['output_throughput']:.0f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lockstep.bench.prefix_routing",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--vocab", type=int, default=1024, help="the model's vocabulary size (prompt ids below it)")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-bytes", type=int, default=16 << 20,
                        help="per engine: 16 MiB is 8k tokens of random:tiny in float32")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                        help="passed to each `lockstep serve` (repeatable), e.g. --engine-arg=--device=cpu")
    parser.add_argument("--conversations", type=int, default=24, help="clients at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=384)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=64, help="sharegpt: output lengths capped here")
    parser.add_argument("--repeats", type=int, default=1, help="runs per (workload, policy), alternating policies")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="default: both")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = {**os.environ, "LOCKSTEP_CPU_THREADS": os.environ.get("LOCKSTEP_CPU_THREADS", "1")}
    ports = [free_port() for _ in range(args.engines)]
    engines = [f"http://127.0.0.1:{port}" for port in ports]
    processes = [subprocess.Popen(engine_command(args.model, port, args), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=env) for port in ports]
    rows = []
    try:
        for url, process in zip(engines, processes):
            wait_healthy(url, process, 300)
        seed = 0
        for workload in args.workload or WORKLOADS:
            for _ in range(args.repeats):
                for policy in POLICIES:
                    seed += 1
                    row = measure(policy, workload, engines, args, seed)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for process in processes:
            stop(process)
    print(table(rows))
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
