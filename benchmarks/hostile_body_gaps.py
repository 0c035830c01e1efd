"""Largest inter-token gap of a running stream while a large hostile body is sent beside it.

One stream (`/v1/completions`, `ignore_eos`) is read chunk by chunk and timed; once it runs, each
body below is sent by a process of its own (so that encoding and sending it holds no GIL of the
process that times the chunks), one after another, and the stream's largest gap between two
chunks while that body was in flight is printed with the answer's status:

* `ids`: a prompt of 2,000,000 token ids (a 16 MB body; past any max_model_len);
* `text`: a 15 MB text prompt;
* `list`: a token-id prompt with a `stop` list of 1,000,000 strings.

Run against `lockstep serve` or a gateway in front of one (a model with a tokenizer, N=1 so a chunk
comes per token, and a body limit of at least 17 MB):

    lockstep serve smollm2 --num-scheduler-steps 1 --max-model-len 1024 --max-request-body-bytes 20000000
    python benchmarks/hostile_body_gaps.py --url http://127.0.0.1:8000 --model smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

SENDER = r"""
import sys, httpx
url, path = sys.argv[1], sys.argv[2]
body = open(path, "rb").read()
print("ready", flush=True)
sys.stdin.readline()
response = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=600)
print(response.status_code, flush=True)
print(response.text[:300], flush=True)
"""


def bodies(model: str) -> dict[str, dict]:
    return {
        "ids": {"model": model, "prompt": [1000 + i % 30000 for i in range(2_000_000)], "max_tokens": 1},
        "text": {"model": model, "prompt": "lorem ipsum dolor sit amet " * (15_000_000 // 27), "max_tokens": 1},
        "list": {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "stop": ["ab"] * 1_000_000},
    }


class Stream:
    """A stream read on a thread of its own; `arrivals` holds each chunk's time."""

    def __init__(self, url: str, model: str, max_tokens: int):
        self.arrivals: list[float] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read, args=(url, model, max_tokens), daemon=True)
        self._thread.start()

    def _read(self, url: str, model: str, max_tokens: int) -> None:
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.arrivals.append(time.monotonic())
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"

    def largest_gap(self, start: float, end: float) -> float:
        times = self.arrivals
        return max((b - a for a, b in zip(times, times[1:]) if b >= start and a <= end), default=float("nan"))

    def ordinary_gap(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.arrivals, self.arrivals[1:]))
        return gaps[len(gaps) // 2] if gaps else float("nan")


def send_beside(stream: Stream, url: str, path: str) -> tuple[str, float, float]:
    """(status and message, seconds to the answer, the stream's largest gap meanwhile); the stream must
    outlast the answer (else the gap is nan)."""
    sender = subprocess.Popen([sys.executable, "-c", SENDER, f"{url}/v1/completions", path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert sender.stdout.readline().strip() == "ready"
    start = time.monotonic()
    sender.stdin.write("go\n")
    sender.stdin.flush()
    output, _ = sender.communicate(timeout=600)
    end = time.monotonic()
    time.sleep(0.3)  # the chunk after the answer closes the last gap
    return output.strip().replace("\n", " "), end - start, stream.largest_gap(start, end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--only", nargs="*", default=None, help="ids, text, list (default: all)")
    parser.add_argument("--max-tokens", type=int, default=800, help="the stream's length")
    parser.add_argument("--repeat", type=int, default=1, help="sends of each body")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for name, body in bodies(args.model).items():
            if args.only is None or name in args.only:
                paths[name] = os.path.join(folder, f"{name}.json")
                with open(paths[name], "w") as handle:
                    json.dump(body, handle)
        print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start")
        ordinary = []
        for name, path in [item for item in paths.items() for _ in range(args.repeat)]:
            stream = Stream(args.url.rstrip("/"), args.model, args.max_tokens)  # a fresh one for each body
            deadline = time.monotonic() + 120
            while len(stream.arrivals) < 10 and time.monotonic() < deadline and stream.error is None:
                time.sleep(0.05)
            if len(stream.arrivals) < 10:
                print(f"the stream did not start: {stream.error}", file=sys.stderr)
                return 1
            answer, seconds, gap = send_beside(stream, args.url.rstrip("/"), path)
            ordinary.append(stream.ordinary_gap())
            print(f"{name:5s} {os.path.getsize(path) / 1e6:5.1f} MB: answered in {seconds:6.2f} s, largest gap "
                  f"{gap * 1000:6.0f} ms | {answer[:160]}", flush=True)
        print(f"median gap of the streams {max(ordinary) * 1000:.0f} ms at most; load average "
              f"{os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
