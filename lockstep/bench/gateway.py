"""`lockstep bench gateway`: what relaying streams costs the gateway, in CPU and in latency (runs on a CPU).

A fake engine (`lockstep.bench.fake_upstream`, its own process) streams OpenAI-shaped completion chunks on
one clock for all streams (`--chunk-interval-ms`), as an engine's decode step does. Many concurrent
streaming clients (raw asyncio, cheap per chunk) read it directly, then through `lockstep gateway` with
1 worker and with 2 (`--workers`). Per run:

* gateway CPU per relayed chunk: the CPU time (user + system, from /proc) of the gateway's processes over
  the stream phase, less what they use idle (health checks and load scrapes, sampled for 3 s before),
  divided by the chunks the clients received;
* gateway CPU per request: the same over a phase of short (one-chunk) streams;
* latency to the first chunk (request written -> first event read) and of each later chunk (written by
  the fake engine -> read by the client; both on this host's monotonic clock), p50 / p99, and what the
  gateway adds to them over the direct run.

The clients, the fake engine and the gateway share the machine: on a loaded or small machine the
latencies include waiting for a core. CPU per chunk does not depend on that.

    lockstep bench gateway                        # 1 and 2 workers, defaults below
    lockstep bench gateway --workers 1 --json result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from lockstep_common.processes import stop_processes

CLK_TCK = os.sysconf("SC_CLK_TCK")
# /proc counts CPU in clock ticks (10 ms at the usual 100 Hz): a figure resting on fewer ticks than this is
# quantisation noise (one tick either way is 10% at 10), so it is reported as unmeasured rather than as a number
MIN_CPU_TICKS = 10
START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
IDLE_SAMPLE_S = 3.0


class BenchError(RuntimeError):
    pass


# ---- the clients ------------------------------------------------------------------------------------------
@dataclass
class Samples:
    first_chunk_s: list[float] = field(default_factory=list)
    chunk_delay_s: list[float] = field(default_factory=list)
    chunks: int = 0
    requests: int = 0
    failed: int = 0


class StreamClient(asyncio.Protocol):
    """One kept-alive connection that sends streamed completions one after another and timestamps each event.

    The response body is read raw: events are found by their `"sent_at":` field, and the stream ends with
    `[DONE]` and the last chunk of the chunked encoding. No JSON parsing, so the client stays cheap."""

    def __init__(self, samples: Samples, record: bool):
        self.samples = samples
        self.record = record
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.lost = asyncio.get_running_loop().create_future()
        self._buffer = b""
        self._sent_at = 0.0
        self._seen_first = False
        self._status_checked = False
        self._chunks = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost mid-stream"))

    def start(self, request: bytes) -> asyncio.Future:
        self.done = asyncio.get_running_loop().create_future()
        self._buffer = b""
        self._seen_first = self._status_checked = False
        self._chunks = 0
        self._sent_at = time.monotonic()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buffer = self._buffer + data
        if not self._status_checked:
            if b"\r\n" not in buffer:
                self._buffer = buffer
                return
            self._status_checked = True
            if not buffer.startswith(b"HTTP/1.1 200"):
                self._finish(BenchError(buffer.split(b"\r\n", 1)[0].decode("latin-1")))
                return
        position = 0
        while True:
            found = buffer.find(b'"sent_at":', position)
            if found < 0:
                break
            end = buffer.find(b"}", found)
            if end < 0:
                break
            self._chunks += 1
            if self.record:
                if not self._seen_first:
                    self.samples.first_chunk_s.append(now - self._sent_at)
                else:
                    self.samples.chunk_delay_s.append(now - float(buffer[found + 10:end]))
            self._seen_first = True
            position = end
        self._buffer = buffer[position:]
        if b"[DONE]" in self._buffer and self._buffer.endswith(b"0\r\n\r\n"):
            self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        if self.done is None or self.done.done():
            return
        if error is None:
            self.samples.chunks += self._chunks
            self.samples.requests += 1
            self.done.set_result(self._chunks)
        else:
            self.done.set_exception(error)


def completion_request(host: str, port: int, chunks: int) -> bytes:
    body = json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": chunks, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def run_clients(host: str, port: int, *, concurrency: int, requests: int, chunks: int, record: bool,
                      progress=None) -> tuple[Samples, float]:
    """`requests` streams of `chunks` chunks over `concurrency` connections; (samples, wall seconds)."""
    loop = asyncio.get_running_loop()
    samples = Samples()
    request = completion_request(host, port, chunks)
    remaining = requests

    async def client() -> None:
        nonlocal remaining
        connection = None
        try:
            while remaining > 0:
                remaining -= 1
                if connection is None or connection.transport.is_closing():
                    _, connection = await loop.create_connection(lambda: StreamClient(samples, record), host, port)
                try:
                    got = await asyncio.wait_for(connection.start(request), REQUEST_TIMEOUT_S)
                    if got != chunks:
                        samples.failed += 1
                except (OSError, BenchError, asyncio.TimeoutError):
                    samples.failed += 1
                    connection.transport.close()
                    connection = None
        finally:
            if connection is not None:
                connection.transport.close()

    started = time.monotonic()
    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    reporter = asyncio.create_task(_report(samples, requests, progress)) if progress else None
    try:
        await asyncio.gather(*tasks)
    finally:
        if reporter is not None:
            reporter.cancel()
    return samples, time.monotonic() - started


async def _report(samples: Samples, requests: int, progress) -> None:
    while True:
        await asyncio.sleep(2.0)
        progress(f"  {samples.requests + samples.failed}/{requests} streams, {samples.chunks} chunks")


# ---- processes and their CPU --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, ()))
    return tree


def measurable(gross_s: float, net_s: float) -> bool:
    """Whether CPU time read from /proc (gross) and net of the idle rate is a figure rather than tick noise."""
    return gross_s * CLK_TCK >= MIN_CPU_TICKS and net_s > 0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (those that exited since are not counted)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
        except (OSError, IndexError, ValueError):
            continue
    return total / CLK_TCK


def read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 answer with a content-length (what /health and /v1/models send), head and body."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            return answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


def wait_ready(port: int, path: bytes, timeout_s: float, process: subprocess.Popen, name: str,
               want: bytes = b"HTTP/1.1 200") -> None:
    """Polls `GET path` until it answers 200 and its answer holds `want`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"{name} exited with {process.returncode} before it was ready")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: bench\r\n\r\n")
                answer = read_response(sock)
            if answer.startswith(b"HTTP/1.1 200") and want in answer:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise BenchError(f"{name} was not ready within {timeout_s:g}s")


def stop(process: subprocess.Popen) -> None:
    stop_processes([process], timeout_s=15)


# ---- one run --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    target: str  # "direct" or "gateway, N worker(s)"
    workers: int
    streams: int
    chunks: int
    failed: int
    wall_s: float
    chunks_per_s: float
    first_chunk_p50_ms: float
    first_chunk_p99_ms: float
    chunk_delay_p50_ms: float
    chunk_delay_p99_ms: float
    cpu_us_per_chunk: float | None = None
    cpu_us_per_request: float | None = None
    cpu_cores: float | None = None  # the gateway's CPU seconds per wall second over the stream phase, net of idle
    idle_cores: float | None = None  # the same with no traffic (its health checks and scrapes of the engine)


def percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(port: int, pids: list[int] | None, args, target: str, workers: int, say) -> Run:
    say(f"{target}: {args.requests} streams of {args.chunks} chunks, {args.concurrency} at a time")
    pids = pids or []
    await run_clients("127.0.0.1", port, concurrency=min(args.concurrency, 8), requests=16, chunks=4,
                      record=False)  # warm: connections, pools, first-time code paths
    idle_cores = 0.0
    if pids:  # health checks and load scrapes: subtracted from what the traffic costs
        cpu_before = cpu_seconds(pids)
        await asyncio.sleep(IDLE_SAMPLE_S)
        idle_cores = (cpu_seconds(pids) - cpu_before) / IDLE_SAMPLE_S
    cpu_before = cpu_seconds(pids)
    samples, wall_s = await run_clients("127.0.0.1", port, concurrency=args.concurrency, requests=args.requests,
                                        chunks=args.chunks, record=True, progress=say)
    stream_gross = cpu_seconds(pids) - cpu_before
    stream_cpu = stream_gross - idle_cores * wall_s
    per_request = None
    if pids and args.short_requests:
        say(f"{target}: {args.short_requests} one-chunk streams, {args.concurrency} at a time")
        cpu_before, short_started = cpu_seconds(pids), time.monotonic()
        short, _ = await run_clients("127.0.0.1", port, concurrency=args.concurrency, requests=args.short_requests,
                                     chunks=1, record=False)
        short_gross = cpu_seconds(pids) - cpu_before
        short_cpu = short_gross - idle_cores * (time.monotonic() - short_started)
        if short.requests and measurable(short_gross, short_cpu):
            per_request = 1e6 * short_cpu / short.requests
        elif short.requests:
            say(f"{target}: the one-chunk streams used {short_gross * 1000:.0f} ms of gateway CPU, too little to "
                f"measure per request (raise --short-requests)")
        samples.failed += short.failed
    run = Run(target, workers, samples.requests, samples.chunks, samples.failed, round(wall_s, 3),
              round(samples.chunks / wall_s, 1),
              percentile_ms(samples.first_chunk_s, 0.5), percentile_ms(samples.first_chunk_s, 0.99),
              percentile_ms(samples.chunk_delay_s, 0.5), percentile_ms(samples.chunk_delay_s, 0.99))
    if pids and samples.chunks and measurable(stream_gross, stream_cpu):
        run.cpu_us_per_chunk = 1e6 * stream_cpu / samples.chunks
        run.cpu_cores = stream_cpu / wall_s
    elif pids and samples.chunks:
        say(f"{target}: the streams used {stream_gross * 1000:.0f} ms of gateway CPU, too little to measure per "
            f"chunk (raise --requests or --chunks)")
    if pids:
        run.cpu_us_per_request = per_request
        run.idle_cores = idle_cores
    say(f"{target}: {samples.requests} streams, {samples.chunks} chunks, {samples.failed} failed"
        + (f", gateway CPU {run.cpu_us_per_chunk:.1f} us/chunk" if run.cpu_us_per_chunk else ""))
    return run


def gateway_command(upstream_port: int, port: int, workers: int, extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "lockstep.cli", "gateway", "--engine", f"http://127.0.0.1:{upstream_port}",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               "--saturation-queue-depth", "0"]
    if workers != 1:
        command += ["--workers", str(workers)]
    return command + extra


async def bench(args, say) -> list[Run]:
    upstream_port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "lockstep.bench.fake_upstream", "--port", str(upstream_port),
                                 "--chunk-interval-ms", str(args.chunk_interval_ms)], stdin=subprocess.DEVNULL)
    runs = []
    try:
        wait_ready(upstream_port, b"/health", START_TIMEOUT_S, upstream, "the fake engine")
        if not args.no_direct:
            runs.append(await measure(upstream_port, None, args, "direct", 0, say))
        for workers in args.workers:
            port = free_port()
            gateway = subprocess.Popen(gateway_command(upstream_port, port, workers, args.gateway_arg),
                                       stdin=subprocess.DEVNULL)
            try:
                # ready once its health checks admitted the engine: /v1/models lists the model
                wait_ready(port, b"/v1/models", START_TIMEOUT_S, gateway, "the gateway", want=b'"bench"')
                runs.append(await measure(port, process_tree(gateway.pid), args,
                                          f"gateway, {workers} worker{'s' if workers > 1 else ''}", workers, say))
            finally:
                stop(gateway)
    finally:
        stop(upstream)
    return runs


def table(runs: list[Run]) -> str:
    direct = next((run for run in runs if run.target == "direct"), None)
    lines = ["| target | CPU us/chunk | CPU us/request | gateway cores | chunks/s | first chunk p50 / p99 ms "
             "| chunk delay p50 / p99 ms | added first chunk p50 / p99 | added chunk delay p50 / p99 | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def num(value, digits=1):
        return "" if value is None else f"{value:.{digits}f}"

    for run in runs:
        added = ("", "")
        if direct is not None and run is not direct:
            added = (f"{run.first_chunk_p50_ms - direct.first_chunk_p50_ms:+.2f} / "
                     f"{run.first_chunk_p99_ms - direct.first_chunk_p99_ms:+.2f}",
                     f"{run.chunk_delay_p50_ms - direct.chunk_delay_p50_ms:+.2f} / "
                     f"{run.chunk_delay_p99_ms - direct.chunk_delay_p99_ms:+.2f}")
        lines.append(f"| {run.target} | {num(run.cpu_us_per_chunk)} | {num(run.cpu_us_per_request)} "
                     f"| {num(run.cpu_cores, 2)} | {run.chunks_per_s:.0f} "
                     f"| {run.first_chunk_p50_ms:.2f} / {run.first_chunk_p99_ms:.2f} "
                     f"| {run.chunk_delay_p50_ms:.2f} / {run.chunk_delay_p99_ms:.2f} | {added[0]} | {added[1]} "
                     f"| {run.failed} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep bench gateway", allow_abbrev=False, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=100, help="streams open at once")
    parser.add_argument("--requests", type=int, default=400, help="streams in the measured phase")
    parser.add_argument("--chunks", type=int, default=100, help="chunks per stream")
    parser.add_argument("--chunk-interval-ms", type=float, default=20.0, help="the fake engine's step time")
    parser.add_argument("--short-requests", type=int, default=500,
                        help="one-chunk streams for the CPU per request (0 = skip)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="gateway --workers to run")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct run (no added latency then)")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `lockstep gateway` (repeatable)")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the runs as JSON here ('-': stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("concurrency", "requests", "chunks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)!r} is out of range: allowed >= 1")
    if args.short_requests < 0:
        parser.error(f"--short-requests={args.short_requests!r} is out of range: allowed >= 0")
    if args.chunk_interval_ms <= 0:
        parser.error(f"--chunk-interval-ms={args.chunk_interval_ms!r} is out of range: allowed > 0")
    if any(workers < 1 for workers in args.workers):
        parser.error(f"--workers={args.workers!r} is out of range: allowed >= 1 each")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        runs = asyncio.run(bench(args, say))
    except BenchError as error:
        print(f"lockstep bench gateway: {error}", file=sys.stderr)
        return 1
    print(table(runs))
    if args.json_path:
        document = json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json_path"},
                               "runs": [asdict(run) for run in runs]}, indent=2)
        if args.json_path == "-":
            print(document)
        else:
            with open(args.json_path, "w") as handle:
                handle.write(document + "\n")
    return 0 if all(run.failed == 0 for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
