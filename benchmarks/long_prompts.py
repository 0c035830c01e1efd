"""Long prompts among streams: what a decoding stream waits while long prompts prefill.

Per server setting, one `lockstep serve` and one run: sharegpt-synth streams arriving as a Poisson
process (`--rate`, 10 req/s) for `--duration` seconds, and among them `--long-len`-token prompts
(6000, `--long-output` 32 tokens each) arriving at `--long-rate` (0.6 req/s), every prompt with ids
of its own (no prefix-cache hits). Each request streams; the client records each chunk's arrival.
Reported per setting: the streams' inter-token gap p50 / p99 / p99.9 / max, their TTFT p50, the long
prompts' TTFT p50 / max, and the engine's idle share (from /metrics). Prints one table; the rows go
to $OUT/long_prompts.json and each server's log to $OUT/server_<name>.log.

    PYTHONPATH=$PWD:$PWD/engine python benchmarks/long_prompts.py \
        --settings "cap0=--long-prefill-token-threshold 0" "cap1024=" "cap2048=--long-prefill-token-threshold 2048"
    PYTHONPATH=$PWD:$PWD/engine python benchmarks/long_prompts.py --model random:tiny \
        --server-args "--device cpu --max-model-len 2048" --long-len 600 --rate 2 --long-rate 0.3 --duration 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h200_served import Server, scrape  # noqa: E402

from lockstep.bench.serve_client import send_request  # noqa: E402
from lockstep.bench.workload import poisson_arrivals, sharegpt_synth  # noqa: E402

OUT = os.environ.get("OUT", ".bench")


def log(message: str) -> None:
    print(f"[long_prompts] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(round(q / 100 * (len(ordered) - 1))), len(ordered) - 1)]


def requests(args, seed: int) -> list[tuple[float, str, dict]]:
    """(send time, kind, payload) for one run, by send time."""
    num_streams = max(1, round(args.rate * args.duration))
    num_long = max(1, round(args.long_rate * args.duration))
    streams = sharegpt_synth(num_streams, seed=seed, vocab_size=args.vocab_size)
    rng = random.Random(f"long-{seed}")
    planned = []
    for kind, count, rate in (("stream", num_streams, args.rate), ("long", num_long, args.long_rate)):
        at = 0.0 if kind == "stream" else 1.0  # the first long prompt once streams run
        for index, delay in enumerate(poisson_arrivals(count, rate, seed=seed + (kind == "long"))):
            at += delay
            if kind == "stream":
                prompt, output = streams[index].prompt_token_ids, streams[index].output_len
            else:
                prompt, output = [rng.randrange(10, args.vocab_size) for _ in range(args.long_len)], args.long_output
            planned.append((at, kind, {"model": args.served_name, "prompt": prompt, "max_tokens": output,
                                       "temperature": 0.0, "ignore_eos": True, "stream": True}))
    return sorted(planned, key=lambda item: item[0])


async def run_load(url: str, planned: list[tuple[float, str, dict]]) -> list[tuple[str, object]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(at: float, kind: str, payload: dict):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return kind, await send_request(client, f"{url}/v1/completions", payload, {})

        return await asyncio.gather(*(one(*item) for item in planned))


def run_setting(name: str, flags: list[str], args, env: dict, seed: int) -> dict:
    server = Server(args.model, args.server_args.split() + flags, name, OUT, env)
    try:
        server.wait_healthy(args.start_timeout)
        log(f"{name}: healthy after {server.startup_s:.1f} s")
        before = scrape(server.url)
        started = time.monotonic()
        results = asyncio.run(run_load(server.url, requests(args, seed)))
        wall = time.monotonic() - started
        after = scrape(server.url)
    finally:
        server.stop()
    failed = [r.error for _, r in results if not r.success]
    stream_gaps = [gap for kind, r in results if kind == "stream" and r.success for gap in r.itl]
    stream_ttft = [r.ttft for kind, r in results if kind == "stream" and r.success]
    long_ttft = [r.ttft for kind, r in results if kind == "long" and r.success]
    busy = after["busy"] - before["busy"]
    row = {
        "setting": name, "flags": " ".join(flags), "streams": len(stream_ttft), "long": len(long_ttft),
        "failed": len(failed), "first_errors": failed[:3], "wall_s": wall,
        "itl_p50_ms": 1e3 * percentile(stream_gaps, 50), "itl_p99_ms": 1e3 * percentile(stream_gaps, 99),
        "itl_p999_ms": 1e3 * percentile(stream_gaps, 99.9), "itl_max_ms": 1e3 * max(stream_gaps, default=0.0),
        "stream_ttft_p50_ms": 1e3 * percentile(stream_ttft, 50),
        "long_ttft_p50_ms": 1e3 * percentile(long_ttft, 50), "long_ttft_max_ms": 1e3 * max(long_ttft, default=0.0),
        "idle_share": 1 - busy / wall if wall else None,
    }
    log(f"{name}: {row}")
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--served-name", default=None, help="model name to send (default: --model)")
    parser.add_argument("--server-args", default="--dtype bfloat16", help="flags every server gets")
    parser.add_argument("--settings", nargs="+", default=["default="], metavar="NAME=FLAGS")
    parser.add_argument("--rate", type=float, default=10.0, help="streams per second (sharegpt-synth)")
    parser.add_argument("--long-rate", type=float, default=0.6, help="long prompts per second")
    parser.add_argument("--long-len", type=int, default=6000)
    parser.add_argument("--long-output", type=int, default=32)
    parser.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--start-timeout", type=float, default=240.0)
    args = parser.parse_args()
    args.served_name = args.served_name or args.model
    os.makedirs(OUT, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rows = []
    for index, spec in enumerate(args.settings):
        name, _, flags = spec.partition("=")
        try:
            rows.append(run_setting(name, flags.split(), args, env, seed=index))
        except Exception as error:  # one setting's failure is its row; the others still run
            log(f"{name}: failed: {error}")
            rows.append({"setting": name, "flags": flags, "error": str(error)[-1500:]})
        with open(os.path.join(OUT, "long_prompts.json"), "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=1)
    print(f"long prompts among streams: {args.model}, streams {args.rate}/s, {args.long_len}-token prompts "
          f"({args.long_output} out) {args.long_rate}/s, {args.duration:.0f} s of arrivals")
    print("| setting | streams / long / failed | ITL p50 / p99 / p99.9 / max (ms) | stream TTFT p50 | "
          "long TTFT p50 / max (ms) | idle |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['setting']} | failed: {row['error'][-200:]} |")
            continue
        print(f"| {row['setting']} | {row['streams']} / {row['long']} / {row['failed']} | "
              f"{row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} / {row['itl_p999_ms']:.1f} / {row['itl_max_ms']:.1f} | "
              f"{row['stream_ttft_p50_ms']:.0f} | {row['long_ttft_p50_ms']:.0f} / {row['long_ttft_max_ms']:.0f} | "
              f"{row['idle_share']:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
