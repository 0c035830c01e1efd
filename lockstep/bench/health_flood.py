"""`lockstep bench health`: how long the gateway's `/health` takes while a flood of streams arrives (runs on a CPU).

The fake engine of `lockstep bench gateway` streams completions on one clock (`--chunk-interval-ms`); `--streams`
clients open their streams at once through one `lockstep gateway` (`--workers`) and read them to the end. A separate prober
process, so that neither the clients' nor the gateway's event loop delays it, opens a new connection every
`--probe-interval-ms` (on a clock, each on a thread of its own) from before the burst to after the last
stream, and sends `GET /health`; its latency is connect to the last byte of the answer. The report: probe
latency p50 / p99 / max, probes that failed (no answer within `PROBE_TIMEOUT_S`) and streams that did not
complete.

`--gateway-pythonpath DIR[:DIR]` runs the gateway from another checkout (its repo root, gateway/ and engine/),
e.g. one from before the health listener, to compare.

    lockstep bench health --streams 3000
    lockstep bench health --streams 3000 --json result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

from lockstep_common.argparsing import ArgumentParser

from lockstep.bench.gateway import (
    START_TIMEOUT_S,
    BenchError,
    free_port,
    gateway_command,
    percentile_ms,
    run_clients,
    stop,
    wait_ready,
)

PROBE_TIMEOUT_S = 10.0
_PROBE = b"GET /health HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n"


def probe_once(port: int) -> float | None:
    """Seconds from connect to the end of /health's answer (a 200); None when it failed or took too long."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.sendall(_PROBE)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError:
        return None
    return time.monotonic() - started if answer.startswith(b"HTTP/1.1 200") else None


def prober(port: int, interval_s: float, stop_file: str) -> None:
    """Starts a probe every `interval_s`, each on a thread of its own, until `stop_file` exists; prints the latencies
    (JSON, null = failed). On a clock, not one after another: a probe that waits seconds does not hide the probes
    that would have waited behind it."""
    latencies: list[float | None] = []
    threads = []
    next_at = time.monotonic()
    while not os.path.exists(stop_file):
        thread = threading.Thread(target=lambda: latencies.append(probe_once(port)), daemon=True)
        thread.start()
        threads.append(thread)
        next_at += interval_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    for thread in threads:
        thread.join(PROBE_TIMEOUT_S + 5)
    print(json.dumps(latencies))


async def flood(args, say) -> dict:
    upstream_port, port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "lockstep.bench.fake_upstream", "--port", str(upstream_port),
                                 "--chunk-interval-ms", str(args.chunk_interval_ms)], stdin=subprocess.DEVNULL)
    env = dict(os.environ)
    if args.gateway_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.gateway_pythonpath, env.get("PYTHONPATH")]))
    extra = ["--max-in-flight", "0", "--max-in-flight-per-engine", "0", *args.gateway_arg]
    gateway = subprocess.Popen(gateway_command(upstream_port, port, args.workers, extra), stdin=subprocess.DEVNULL,
                               env=env)
    stop_file = f"/tmp/lockstep-bench-health-{os.getpid()}.stop"
    try:
        wait_ready(upstream_port, b"/health", START_TIMEOUT_S, upstream, "the fake engine")
        wait_ready(port, b"/v1/models", START_TIMEOUT_S, gateway, "the gateway", want=b'"bench"')
        probes = subprocess.Popen([sys.executable, "-m", "lockstep.bench.health_flood", "--probe-port", str(port),
                                   "--probe-interval-ms", str(args.probe_interval_ms), "--stop-file", stop_file],
                                  stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        await asyncio.sleep(1.0)  # probes of an idle gateway first
        say(f"{args.streams} streams of {args.chunks} chunks at once, every {args.chunk_interval_ms} ms")
        samples, wall_s = await run_clients("127.0.0.1", port, concurrency=args.streams, requests=args.streams,
                                            chunks=args.chunks, record=False, progress=say)
        await asyncio.sleep(1.0)
        open(stop_file, "w").close()
        output, _ = probes.communicate(timeout=PROBE_TIMEOUT_S + 30)
    finally:
        stop(gateway)
        stop(upstream)
        if os.path.exists(stop_file):
            os.unlink(stop_file)
    latencies = json.loads(output)
    answered = [latency for latency in latencies if latency is not None]
    return {"workers": args.workers, "streams": args.streams, "chunks_per_stream": args.chunks, "chunk_interval_ms": args.chunk_interval_ms,
            "streams_failed": samples.failed, "streams_s": round(wall_s, 2), "probes": len(latencies),
            "probes_failed": len(latencies) - len(answered), "probe_p50_ms": round(percentile_ms(answered, 0.5), 1),
            "probe_p99_ms": round(percentile_ms(answered, 0.99), 1),
            "probe_max_ms": round(1000 * max(answered), 1) if answered else None}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="lockstep bench health", description=__doc__.split("\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--streams", type=int, default=3000, help="streams opened at once")
    parser.add_argument("--chunks", type=int, default=50, help="chunks per stream")
    parser.add_argument("--workers", type=int, default=1, help="the gateway's --workers")
    parser.add_argument("--chunk-interval-ms", type=float, default=200.0, help="the fake engine's clock")
    parser.add_argument("--probe-interval-ms", type=float, default=50.0, help="between two /health probes")
    parser.add_argument("--gateway-pythonpath", default=None, metavar="DIR[:DIR]",
                        help="PYTHONPATH for the gateway only (another checkout's code)")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="passed to `lockstep gateway` (repeatable; --gateway-arg=--flag=value)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the result here")
    parser.add_argument("--probe-port", type=int, default=None, help=argparse.SUPPRESS)  # the prober process
    parser.add_argument("--stop-file", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe_port is not None:
        prober(args.probe_port, args.probe_interval_ms / 1000, args.stop_file)
        return 0
    for name in ("streams", "chunks", "workers"):
        if getattr(args, name) < 1:
            build_parser().error(f"--{name}={getattr(args, name)} is out of range: allowed >= 1")

    def say(line: str) -> None:
        print(f"[bench health] {line}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(flood(args, say))
    except BenchError as error:
        say(f"error: {error}")
        return 1
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0 if not result["probes_failed"] and not result["streams_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
