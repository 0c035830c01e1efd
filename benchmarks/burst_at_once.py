"""A batch job sent in one go: N streamed completions at once, through `lockstep up` and directly to an engine.

What a script does with `asyncio.gather` over the OpenAI client: every request opened at the same
instant. Per target, counted from the client: served (200, the stream ended with `[DONE]` and carried
no error event), refused (a status other than 200, with its Retry-After), broken (200 but an error
event, no `[DONE]`, or a lost connection), and the wall time. Through the gateway it also samples,
every 0.5 s, the `lockstep up` process's RSS (the gateway runs in it; the engines are other
processes) and the gateway's queue depth, and reports the gateway's CPU per request (all of its work:
admission, queue, relay) and the memory per queued request as (RSS at the
deepest queue - RSS just before the burst) / that depth. Directly, it samples the engine's processes
(API server, core, health listener) and reports their RSS before the burst and at its peak.

Defaults are `lockstep up`'s and `lockstep serve`'s own (the engine on the CPU); only the burst is set:

    PYTHONPATH=$PWD:$PWD/engine:$PWD/gateway python benchmarks/burst_at_once.py \
        --model random:tiny --requests 10000 --max-tokens 8

The client is one process with a bare HTTP/1.1 exchange per request (a connection each, `Connection:
close`), so it costs the machine little beside the stack it measures. Results go to stdout as a table
and to $OUT/burst_at_once.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

OUT = os.environ.get("OUT", ".bench")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(message: str) -> None:
    print(f"[burst_at_once] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Outcome:
    target: str
    requests: int
    served: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # status -> count
    retry_after: list[int] = field(default_factory=list)  # distinct values seen
    refused_examples: list[str] = field(default_factory=list)  # distinct messages, the first few
    broken: int = 0
    broken_examples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    rss_before_mib: float = 0.0
    rss_peak_mib: float = 0.0
    deepest_queue: int = 0
    rss_at_deepest_mib: float = 0.0
    kib_per_queued_request: float | None = None
    cpu_ms_per_request: float = 0.0  # the sampled process's CPU (user + system) over the burst, per request
    load_before: str = ""
    load_after: str = ""


def rss_mib(pid: int, with_children: bool = False) -> float:
    """VmRSS of `pid` (and of its children: the engine's core and health listener)."""
    pids = [pid]
    if with_children:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            pids += [int(child) for child in children.read().split()]
    total = 0.0
    for one in pids:
        try:
            with open(f"/proc/{one}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            continue
    return total


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def one_request(host: str, port: int, body: bytes, outcome: Outcome, deadline: float) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    try:
        async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(head + body)
                data = await reader.read(-1)  # until the server closes: Connection: close
            finally:
                writer.close()
    except (OSError, TimeoutError) as error:
        outcome.broken += 1
        if len(outcome.broken_examples) < 5:
            outcome.broken_examples.append(f"{type(error).__name__}: {error}")
        return
    status_line, _, rest = data.partition(b"\r\n")
    parts = status_line.split()
    status = parts[1].decode() if len(parts) > 1 else "none"
    headers, _, payload = rest.partition(b"\r\n\r\n")
    if status != "200":
        outcome.refused[status] = outcome.refused.get(status, 0) + 1
        match = re.search(rb"(?im)^retry-after:\s*(\d+)", headers)
        if match and int(match.group(1)) not in outcome.retry_after and len(outcome.retry_after) < 20:
            outcome.retry_after.append(int(match.group(1)))
        message = re.sub(rb"\d+", b"N", payload[-400:]).decode(errors="replace")  # one per kind, not per count
        if message not in outcome.refused_examples and len(outcome.refused_examples) < 5:
            outcome.refused_examples.append(message)
        return
    if b"data: [DONE]" in payload and b'"error"' not in payload:
        outcome.served += 1
        return
    outcome.broken += 1
    if len(outcome.broken_examples) < 5:
        outcome.broken_examples.append(payload[-300:].decode(errors="replace"))


async def sample(pid: int, metrics_url: str | None, outcome: Outcome, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            rss = rss_mib(pid, with_children=metrics_url is None)
            outcome.rss_peak_mib = max(outcome.rss_peak_mib, rss)
            if metrics_url is not None:
                try:
                    text = (await client.get(metrics_url)).text
                    depth = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                if line.startswith("lockstep_gateway_queue_depth{"))
                except (httpx.HTTPError, ValueError, IndexError):
                    depth = 0
                if depth > outcome.deepest_queue:  # the RSS read after the scrape answered, not before
                    outcome.deepest_queue, outcome.rss_at_deepest_mib = int(depth), rss_mib(pid)
            with_timeout = asyncio.ensure_future(stop.wait())
            await asyncio.wait([with_timeout], timeout=0.5)
            with_timeout.cancel()


async def burst(target: str, host: str, port: int, pid: int, metrics_url: str | None, args) -> Outcome:
    outcome = Outcome(target, args.requests)
    body = json.dumps({"model": args.model, "prompt": list(range(100, 100 + args.prompt_tokens)),
                       "max_tokens": args.max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    outcome.rss_before_mib = rss_mib(pid, with_children=metrics_url is None)
    outcome.load_before = loadavg()
    cpu_before = cpu_seconds(pid)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(pid, metrics_url, outcome, stop))
    started = time.monotonic()
    deadline = started + args.timeout
    await asyncio.gather(*(one_request(host, port, body, outcome, deadline) for _ in range(args.requests)))
    outcome.wall_s = round(time.monotonic() - started, 1)
    outcome.cpu_ms_per_request = round((cpu_seconds(pid) - cpu_before) * 1000 / args.requests, 2)
    stop.set()
    await sampler
    outcome.load_after = loadavg()
    if outcome.deepest_queue:
        outcome.kib_per_queued_request = round(
            (outcome.rss_at_deepest_mib - outcome.rss_before_mib) * 1024 / outcome.deepest_queue, 1)
    return outcome


def start(argv: list[str], log_path: str) -> subprocess.Popen:
    with open(log_path, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "lockstep.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, start_new_session=True)


def wait_ready(process: subprocess.Popen, url: str, ready, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        try:
            if ready(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready within {timeout:.0f}s")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_target(target: str, args) -> Outcome:
    port = free_port()
    log_path = os.path.join(OUT, f"burst_{target}.log")
    if target == "gateway":
        process = start(["up", args.model, "--port", str(port), *args.server_args], log_path)
        wait_ready(process, f"http://127.0.0.1:{port}/health", lambda r: r.json().get("healthy_engines") == 1)
        metrics_url = f"http://127.0.0.1:{port}/metrics"
    else:
        process = start(["serve", args.model, "--host", "127.0.0.1", "--port", str(port), *args.server_args],
                        log_path)
        wait_ready(process, f"http://127.0.0.1:{port}/health", lambda r: r.status_code == 200)
        metrics_url = None
    try:
        log(f"{target}: ready on port {port}; {args.requests} streamed requests at once (load {loadavg()})")
        # The RSS sampled: `lockstep up`'s process (the gateway), or `lockstep serve`'s (the engine's API server).
        outcome = asyncio.run(burst(target, "127.0.0.1", port, process.pid, metrics_url, args))
    finally:
        stop(process)
    log(f"{target}: {outcome.served}/{outcome.requests} served in {outcome.wall_s}s, refused {outcome.refused}, "
        f"broken {outcome.broken} (log {log_path})")
    for example in outcome.refused_examples + outcome.broken_examples:
        log(f"{target}: e.g. {example}")
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length, as token ids (any model)")
    parser.add_argument("--targets", nargs="+", default=["gateway", "engine"], choices=["gateway", "engine"])
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for `lockstep up` / `lockstep serve` (none: their defaults)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole burst may take")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    outcomes = [run_target(target, args) for target in args.targets]
    print("| target | served | refused | broken | wall s | load before -> after | CPU ms/request | memory |")
    print("|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        memory = f"{o.kib_per_queued_request} KiB ({o.deepest_queue} queued, RSS {o.rss_before_mib:.0f} -> " \
                 f"{o.rss_at_deepest_mib:.0f} MiB, peak {o.rss_peak_mib:.0f})" if o.kib_per_queued_request is not None \
            else f"RSS {o.rss_before_mib:.0f} -> peak {o.rss_peak_mib:.0f} MiB"
        print(f"| {o.target} | {o.served}/{o.requests} | {o.refused or 0} | {o.broken} | {o.wall_s} | "
              f"{o.load_before} -> {o.load_after} | {o.cpu_ms_per_request} | {memory} |")
    with open(os.path.join(OUT, "burst_at_once.json"), "w") as f:
        json.dump([asdict(o) for o in outcomes], f, indent=1)
    return 0 if all(o.served == o.requests for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
