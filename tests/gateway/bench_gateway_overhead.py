"""Gateway overhead: the same requests sent to an upstream directly and through `lockstep gateway`.

A script with a report, not a test (`python tests/gateway/bench_gateway_overhead.py`). The upstream
is a minimal OpenAI-shaped server (uvicorn, answers at once), so the difference is the gateway's own
cost: added latency per request (p50/p99), added time per streamed chunk, proxied requests/s, and
1,000 concurrent streams on loopback with their failures counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx

UPSTREAM = r'''
import sys, uvicorn
MODELS = b'{"object":"list","data":[{"id":"bench"}]}'
DONE = b'{"id":"x","object":"text_completion","model":"bench","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
CHUNK = b'data: {"id":"x","object":"text_completion","model":"bench","choices":[{"index":0,"text":"t"}]}\n\n'
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    if scope["method"] == "POST":
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if b'"stream":true' in body.replace(b" ", b""):
            n = int(body.split(b'"max_tokens":')[1].split(b",")[0].split(b"}")[0])
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(n):
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        payload = DONE
    else:
        payload = MODELS if path == "/v1/models" else b"vllm:num_requests_running 0\n" if path == "/metrics" else b"{}"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
'''


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_up(url: str, path: str = "/health", timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential_latency(url: str, n: int) -> list[float]:
    body = {"model": "bench", "prompt": [1], "max_tokens": 1}
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            start = time.perf_counter()
            response = await client.post(url + "/v1/completions", json=body)
            out.append(time.perf_counter() - start)
            assert response.status_code == 200
    return out


async def stream_time(url: str, chunks: int, n: int) -> list[float]:
    body = {"model": "bench", "prompt": [1], "max_tokens": chunks, "stream": True}
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(n):
            start = time.perf_counter()
            seen = 0
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    seen += line.startswith("data: {")
            out.append(time.perf_counter() - start)
            assert seen == chunks, seen
    return out


async def throughput(url: str, concurrency: int, duration_s: float) -> float:
    body = {"model": "bench", "prompt": [1], "max_tokens": 1}
    done = 0
    deadline = time.monotonic() + duration_s

    async def worker(client):
        nonlocal done
        while time.monotonic() < deadline:
            response = await client.post(url + "/v1/completions", json=body)
            assert response.status_code == 200
            done += 1

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.monotonic()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        return done / (time.monotonic() - start)


async def concurrent_streams(url: str, n: int, chunks: int) -> tuple[int, float]:
    body = {"model": "bench", "prompt": [1], "max_tokens": chunks, "stream": True}

    async def one(client) -> bool:
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return False
                text = (await response.aread()).decode()
                return text.count("data: {") == chunks and text.endswith("data: [DONE]\n\n")
        except httpx.HTTPError:
            return False

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        start = time.monotonic()
        results = await asyncio.gather(*[one(client) for _ in range(n)])
        return sum(not ok for ok in results), time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--concurrent-streams", type=int, default=1000)
    args = parser.parse_args()
    up_port, gw_port = free_port(), free_port()
    upstream_url, gateway_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)], env=env)
    gateway = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "gateway", "--host", "127.0.0.1", "--port",
                                str(gw_port), "--engine", upstream_url, "--log-level", "warning"], env=env)
    try:
        wait_up(upstream_url)
        wait_up(gateway_url, "/v1/models")
        while not httpx.get(gateway_url + "/v1/models").json()["data"]:
            time.sleep(0.05)
        report = {}
        for name, url in (("direct", upstream_url), ("gateway", gateway_url)):
            asyncio.run(sequential_latency(url, 50))  # warm up
            latency = asyncio.run(sequential_latency(url, args.requests))
            streams = asyncio.run(stream_time(url, args.chunks, args.streams))
            report[name] = {"p50_ms": percentile(latency, 0.5) * 1e3, "p99_ms": percentile(latency, 0.99) * 1e3,
                            "per_chunk_ms": statistics.median(streams) / args.chunks * 1e3,
                            "requests_per_s": asyncio.run(throughput(url, 32, 5.0))}
        failures, seconds = asyncio.run(concurrent_streams(gateway_url, args.concurrent_streams, 20))
        d, g = report["direct"], report["gateway"]
        print(json.dumps(report, indent=2))
        print(f"added latency per request: p50 {g['p50_ms'] - d['p50_ms']:.3f} ms, p99 {g['p99_ms'] - d['p99_ms']:.3f} ms")
        print(f"added time per streamed chunk: {g['per_chunk_ms'] - d['per_chunk_ms']:.4f} ms")
        print(f"requests/s (32 concurrent): direct {d['requests_per_s']:.0f}, through the gateway {g['requests_per_s']:.0f}")
        print(f"{args.concurrent_streams} concurrent streams x 20 chunks through the gateway: {failures} failed, "
              f"{seconds:.1f} s")
        return 0
    finally:
        for process in (gateway, upstream):
            process.terminate()
            process.wait(timeout=20)


if __name__ == "__main__":
    sys.exit(main())
