"""What `--stream-interval` saves the API server: its process's CPU per output token, streaming.

For each interval, one `lockstep serve random:tiny` (CPU, tiny model: the engine core is cheap, so the API
process's own work stands out) serves `--concurrency` streaming completions at once of `--max-tokens` tokens
each (ignore_eos), `--rounds` times, read by an httpx client in this process. The figure is the API process's
CPU (user + system from /proc, its engine-core child excluded) over the output tokens, and the SSE chunks
the client counted.

    python benchmarks/stream_interval_cost.py [--intervals 1 4 16 --concurrency 64 --max-tokens 128 --rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "api"))
from api_harness import Server  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


async def one(client: httpx.AsyncClient, url: str, max_tokens: int, seed: int) -> int:
    body = {"model": "random:tiny", "prompt": [seed % 500 + 1, 7, 9], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
    return chunks


async def load(url: str, concurrency: int, max_tokens: int, rounds: int) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        started = time.perf_counter()
        chunks = 0
        for round_ in range(rounds):
            counts = await asyncio.gather(*(one(client, url, max_tokens, round_ * concurrency + i)
                                            for i in range(concurrency)))
            chunks += sum(counts)
        return chunks, time.perf_counter() - started


def measure(interval: int, args) -> dict:
    server = Server("random:tiny", "--stream-interval", str(interval), "--max-num-seqs", str(args.concurrency),
                    "--num-gpu-blocks-override", "2048", "--max-model-len", "512", "--skip-warmup",
                    name=f"interval {interval}").wait_healthy()
    try:
        asyncio.run(load(server.url, 4, 8, 1))  # first requests: imports and allocations out of the figure
        before = cpu_seconds(server.process.pid)
        chunks, wall = asyncio.run(load(server.url, args.concurrency, args.max_tokens, args.rounds))
        cpu = cpu_seconds(server.process.pid) - before
    finally:
        server.stop()
    tokens = args.concurrency * args.max_tokens * args.rounds
    return {"interval": interval, "tokens": tokens, "chunks": chunks, "wall_s": wall, "api_cpu_s": cpu,
            "api_cpu_us_per_token": cpu / tokens * 1e6, "tokens_per_s": tokens / wall}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for interval in args.intervals:
        rows.append(measure(interval, args))
        print(f"[stream_interval_cost] interval {interval}: {rows[-1]}", file=sys.stderr, flush=True)
    print("| --stream-interval | SSE chunks | API process CPU s | API CPU µs per token | tokens/s (wall) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['interval']} | {row['chunks']} | {row['api_cpu_s']:.2f} | {row['api_cpu_us_per_token']:.1f} | "
              f"{row['tokens_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
