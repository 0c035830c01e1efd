"""A 100,000-choice `guided_choice` beside a running stream: what the stream waits meanwhile.

One `lockstep serve` at N=1 (a chunk per token). Per run: a stream of 120 tokens (`ignore_eos`); at
its fifth chunk a completion with 100,000 choices (`option number N`, a new list every run unless
`warm`); the stream is read until that answer comes. Printed per run: the answer's status and text,
how long it took, the stream's median gap before it was sent, and its largest and median gap while
it was under way (the figure `test_100000_choices_compile_beside_a_stream_that_keeps_its_cadence`
bounds at 0.5 s). Variants: `cold` (a new list), `warm` (the previous list again: both caches hit),
`body` (the same 2.3 MB body with the list in a field the server ignores: no grammar).

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/guided_cadence.py --runs 3
    PYTHONPATH=$PWD:$PWD/engine taskset -c 0,1 python benchmarks/guided_cadence.py \
        --model random:smollm2-135m --server-args "--device cpu --tokenizer DIR"   # two cores of a big host
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def start_server(model: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), f"guided_cadence_{port}.log"), "wb")
    env = {**os.environ, "LOCKSTEP_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # as the API tests run it
    process = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", model, "--host", "127.0.0.1",
                                "--port", str(port), "--num-scheduler-steps", "1", "--max-model-len", "128",
                                "--kv-cache-memory-bytes", str(128 << 20), *args],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not become healthy (log: {log.name})")


def one_run(url: str, model: str, body: dict) -> str:
    arrivals: list[float] = []
    guided: dict = {}

    def send() -> None:
        started = time.monotonic()
        guided["response"] = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
        guided["span"] = (started, time.monotonic())

    sender = threading.Thread(target=send)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True,
            "stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 5:
                sender.start()
            if len(arrivals) > 5 and not sender.is_alive():
                break
    sender.join(120)
    start, end = guided["span"]
    before = sorted(b - a for a, b in zip(arrivals, arrivals[1:]) if b < start)
    during = sorted(b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end)
    response = guided["response"]
    answer = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text[:80]
    return (f"{response.status_code} {answer!r} in {end - start:.2f} s; gaps before: median {before[len(before) // 2]:.3f} s; "
            f"meanwhile: {len(during)}, largest {during[-1]:.3f} s, median {during[len(during) // 2]:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--server-args", default="", help="more `lockstep serve` flags, one string")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", default="cold", help="comma-separated: cold, warm, body")
    args = parser.parse_args()
    process, url = start_server(args.model, args.server_args.split())
    try:
        previous = None
        for run in range(args.runs):
            for variant in args.variants.split(","):
                if variant == "warm" and previous is not None:
                    extra = {"guided_choice": previous}
                elif variant == "body":
                    extra = {"ignored_by_the_server": [f"option number {i}" for i in range(100_000)]}
                else:
                    previous = [f"option number {i}" + (f" r{run}" if run else "") for i in range(100_000)]
                    extra = {"guided_choice": previous}
                body = {"model": args.model, "prompt": "Pick one:", "max_tokens": 20, **extra}
                print(f"run {run} {variant}: {one_run(url, args.model, body)}", flush=True)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


if __name__ == "__main__":
    main()
