"""The API server's CPU per request: what taking a request costs the process that must take a burst of them.

One `lockstep serve random:tiny` (CPU, tiny model, `--skip-warmup`) per round takes `--requests` streamed
completions of one token with `--prompt-tokens` token-id prompts, `--concurrency` in flight, from an httpx
client in this process. The figure is the API process's CPU (user + system from /proc, its engine-core child
excluded) over the requests. With `--trees`, each round serves from another tree (a `git archive` of one
holding `engine/`, put first on PYTHONPATH), alternating, so two versions of the request path compare on
one machine:

    python benchmarks/api_request_cost.py [--requests 1000 --concurrency 100 --prompt-tokens 200 --rounds 2]
    python benchmarks/api_request_cost.py --trees /tmp/old /tmp/new --pairs 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "api"))
from api_harness import Server  # noqa: E402

from lockstep.bench.gateway import cpu_seconds  # noqa: E402


async def one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> bool:
    """Whether the request was served (a connection the server closed under the burst counts as not)."""
    body = {"model": "random:tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for _ in response.aiter_lines():
                pass
    except httpx.TransportError:
        return False
    return True


async def burst(url: str, requests: int, concurrency: int, prompt_tokens: int) -> tuple[float, int]:
    """(wall seconds, requests not served)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def limited(i: int) -> bool:
            async with gate:
                return await one(client, url, [i % 500 + 1] * prompt_tokens)

        started = time.perf_counter()
        served = await asyncio.gather(*(limited(i) for i in range(requests)))
        return time.perf_counter() - started, served.count(False)


def measure(tree: str | None, args) -> list[dict]:
    original = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(tree, "engine"), original]))
    try:
        server = Server("random:tiny", "--skip-warmup", "--max-num-seqs", str(args.concurrency),
                        "--num-gpu-blocks-override", "4096", "--max-model-len", "1024", "--device", "cpu",
                        name=f"tree {tree}").wait_healthy()
    finally:
        if original is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = original
    try:
        asyncio.run(burst(server.url, 200, args.concurrency, args.prompt_tokens))  # imports, allocations
        rows = []
        for _ in range(args.rounds):
            before = cpu_seconds([server.process.pid])
            wall, failed = asyncio.run(burst(server.url, args.requests, args.concurrency, args.prompt_tokens))
            rows.append({"tree": tree or "this", "wall_s": wall, "failed": failed,
                         "api_cpu_ms_per_request": (cpu_seconds([server.process.pid]) - before) / args.requests * 1e3})
        return rows
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="bursts per server")
    parser.add_argument("--trees", nargs="+", default=[None], help="trees holding engine/, served in turn")
    parser.add_argument("--pairs", type=int, default=1, help="times the trees are served in turn")
    args = parser.parse_args()
    rows = []
    for _ in range(args.pairs):
        for tree in args.trees:
            rows += measure(tree, args)
            print(f"[api_request_cost] {rows[-args.rounds:]}", file=sys.stderr, flush=True)
    print("| tree | bursts | API CPU ms per request (each burst) | median | requests not served |")
    print("|---|---|---|---|---|")
    for tree in dict.fromkeys(row["tree"] for row in rows):
        own = [row for row in rows if row["tree"] == tree]
        costs = [row["api_cpu_ms_per_request"] for row in own]
        print(f"| {tree} | {len(costs)} | {', '.join(f'{c:.2f}' for c in costs)} | {statistics.median(costs):.2f} | "
              f"{sum(row['failed'] for row in own)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
