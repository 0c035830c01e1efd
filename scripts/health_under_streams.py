"""/health latency while N streams are open against a running `lockstep serve` (the goal: within 100 ms
at 3000 streams).

    .venv/bin/python scripts/health_under_streams.py --url http://127.0.0.1:8000 --streams 3000

Opens `--streams` streamed completions at once (`max_tokens`, `ignore_eos`), probes /health every
50 ms from a process of its own (a new connection per probe with `Connection: close`, as a kubelet
does; in the streams' process the probe would time that process's GIL, not the server), and prints the probes'
p50/p99/max with the streams' outcomes. The server needs room for them: `--max-queued-requests -1`
(or a limit above the streams) so none is refused with 503.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import time
import urllib.parse

import httpx


def probe_health(url: str, stop, results) -> None:
    # http.client, not httpx.get: that builds a TLS context per call, tens of ms of the prober's own CPU on
    # a loaded machine, which the latency would then include
    where = urllib.parse.urlsplit(url)
    latencies, failures = [], []
    while not stop.is_set():
        started = time.monotonic()
        connection = http.client.HTTPConnection(where.hostname, where.port or 80, timeout=30)
        try:
            connection.request("GET", "/health", headers={"Connection": "close"})
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as error:
            failures.append(type(error).__name__)
        else:
            latencies.append((time.monotonic() - started, started))
            if response.status != 200:
                failures.append(f"status {response.status}: {body[:160].decode(errors='replace')}")
        finally:
            connection.close()
        stop.wait(0.05)
    results.put((latencies, failures))


async def one_stream(http: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> str:
    body = {"model": model, "prompt": [1 + i % 50, 7, 9], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return "complete"
            return "ended early"
    except httpx.HTTPError as error:
        return type(error).__name__


async def run(args) -> None:
    limits = httpx.Limits(max_connections=args.streams + 10, max_keepalive_connections=args.streams + 10)
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    prober = context.Process(target=probe_health, args=(args.url, stop, results), daemon=True)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as http:
        prober.start()
        outcomes = await asyncio.gather(*(one_stream(http, args.url, args.model, i, args.max_tokens)
                                          for i in range(args.streams)))
    stop.set()
    latencies, failures = results.get(timeout=60)
    prober.join(30)
    counts = {outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes))}
    print(f"{args.streams} streams x {args.max_tokens} tokens in {time.monotonic() - started:.1f} s: {counts}")
    if latencies:
        slowest = sorted(latencies, reverse=True)[:3]
        latencies = sorted(latency for latency, _ in latencies)
        print(f"/health: {len(latencies)} probes, p50 {quantile(latencies, 0.5):.0f} ms, "
              f"p99 {quantile(latencies, 0.99):.0f} ms, max {latencies[-1] * 1000:.0f} ms; failures: {len(failures)}")
        print("  slowest: " + ", ".join(f"{latency * 1000:.0f} ms at {at - started:.1f} s" for latency, at in slowest))
    for failure in sorted(set(failures)):
        print(f"  {failures.count(failure)} x {failure}")


def quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--streams", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=200)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
