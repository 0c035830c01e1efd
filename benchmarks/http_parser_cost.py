"""What a streamed chunk costs the API process's CPU with each HTTP/1.1 protocol the engine can run.

One uvicorn server per protocol (the engine's header-limited httptools and h11 protocols,
engine/lockstep_engine/api/http_limits.py) and event loop (asyncio, uvloop), each in its own process, serving a
FastAPI `StreamingResponse` of `--chunks` SSE events shaped like a completion chunk; `--concurrency` streams at
once, `--rounds` times, read by an httpx client in this process. The server's CPU (user + system, from its
own getrusage) over the streamed chunks is the figure.

    python benchmarks/http_parser_cost.py [--chunks 200 --concurrency 64 --rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = "data: " + json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1700000000,
                               "model": "smollm2", "choices": [{"index": 0, "text": " token", "logprobs": None,
                                                                "finish_reason": None}]}) + "\n\n"


def serve(parser: str, loop: str, port: int, chunks: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from lockstep_engine.api.http_limits import header_timeout_protocol

    app = FastAPI()

    @app.get("/stream")
    async def stream():
        async def events():
            for i in range(chunks):
                yield CHUNK
                if i % 8 == 7:  # the engine's output arrives a window at a time
                    await asyncio.sleep(0)
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/cpu")
    def cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_s": usage.ru_utime + usage.ru_stime}

    uvicorn.run(app, host="127.0.0.1", port=port, http=header_timeout_protocol(10.0, parser), loop=loop,
                log_level="warning")


async def measure(port: int, chunks: int, concurrency: int, rounds: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        deadline = time.monotonic() + 30
        while True:
            try:
                before = (await client.get(f"http://127.0.0.1:{port}/cpu")).json()["cpu_s"]
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

        async def one() -> int:
            received = 0
            async with client.stream("GET", f"http://127.0.0.1:{port}/stream") as response:
                async for data in response.aiter_bytes():
                    received += data.count(b"data: ")
            return received

        started = time.monotonic()
        received = 0
        for _ in range(rounds):
            received += sum(await asyncio.gather(*[one() for _ in range(concurrency)]))
        wall = time.monotonic() - started
        after = (await client.get(f"http://127.0.0.1:{port}/cpu")).json()["cpu_s"]
    assert received == chunks * concurrency * rounds, (received, chunks * concurrency * rounds)
    return {"server_cpu_s": after - before, "wall_s": wall, "chunks": received,
            "us_per_chunk": 1e6 * (after - before) / received}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", nargs=3, metavar=("PARSER", "LOOP", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]), args.chunks)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "engine"),
                                                       os.environ.get("PYTHONPATH", "")]))
    print("| parser | loop | server CPU µs per chunk | wall s |")
    print("|---|---|---|---|")
    for http_parser in ("h11", "httptools"):
        for loop in ("asyncio", "uvloop"):
            port = free_port()
            server = subprocess.Popen([sys.executable, __file__, "--chunks", str(args.chunks), "--serve", http_parser,
                                       loop, str(port)], env=env)
            try:
                result = asyncio.run(measure(port, args.chunks, args.concurrency, args.rounds))
            finally:
                server.terminate()
                server.wait(30)
            print(f"| {http_parser} | {loop} | {result['us_per_chunk']:.1f} | {result['wall_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
