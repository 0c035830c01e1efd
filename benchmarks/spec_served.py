"""Speculation as a user sees it: `lockstep serve` with and without n-gram drafting, a copying workload
streamed through /v1/chat/completions at a few concurrencies (batch 1 and batch 32 by default).

Each request asks the model to copy one of `--requests` distinct paragraphs word for word (greedy,
`max_tokens` `--max-tokens`); a concurrency level keeps that many streams open until every request has
been sent once. Per run: requests/s, output tokens/s, TTFT p50, TPOT p50 (a request's (last token -
first token) / (tokens - 1), so several tokens in one chunk count as they should), inter-chunk p50 /
p99, and from /metrics the drafts, draft tokens and accepted tokens (acceptance = accepted / draft
tokens; tokens per verify forward = 1 + accepted / drafts). The same requests go to every setting, and
each setting's greedy texts must equal the first setting's (the run says which differ, if any).

    python benchmarks/spec_served.py                          # on the H200, smollm2 from LOCKSTEP_CACHE
    LOCKSTEP_SERVED_SMALL=1 python benchmarks/spec_served.py  # CPU dry run (smollm2, 2 requests each)

Prints one table; the numbers go to $OUT/spec_served.json and the servers' logs to $OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_served import Server  # noqa: E402  (benchmarks/ is not a package)

SMALL = os.environ.get("LOCKSTEP_SERVED_SMALL") == "1"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
SENTENCES = [
    "The printing press spread across Europe within fifty years of its invention.",
    "Scholars could compare identical copies of a text for the first time.",
    "Errors found in one edition were corrected in the next.",
    "Ideas travelled faster than ever before, and so did arguments about them.",
    "The river rises every spring when the snow melts in the mountains.",
    "Farmers along its banks plant late, after the water has gone down.",
    "A lighthouse keeper wrote down the weather every morning for forty years.",
    "Her notebooks are now the longest record of storms on that coast.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Knead the dough for ten minutes and let it rest under a cloth.",
    "The committee met on Tuesday and agreed to repair the old bridge.",
    "Work will begin in March and should be finished before the summer.",
    "Bees communicate the direction of flowers with a short dance.",
    "The angle of the dance points the way relative to the sun.",
    "The library opens at nine and closes at six on weekdays.",
    "On Saturdays it closes at noon, and it is closed on Sundays.",
]


def log(message: str) -> None:
    print(f"[spec_served] {message}", file=sys.stderr, flush=True)


def paragraphs(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(SENTENCES, 4)) for _ in range(count)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, text: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Copy this paragraph word for word, nothing else:\n\n{text}"}]}
    started = time.perf_counter()
    chunk_times, pieces, tokens = [], [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    chunk_times.append(time.perf_counter() - started)
                    pieces.append(content)
    return {"text": "".join(pieces), "tokens": tokens, "chunk_times": chunk_times}


async def run_level(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> tuple[list, float]:
    queue = list(enumerate(texts))
    results: list = [None] * len(texts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        async def worker() -> None:
            while queue:
                index, text = queue.pop(0)
                results[index] = await one_request(client, url, model, text, max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def spec_counters(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            totals[names[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def summarize(results: list, wall: float, before: dict, after: dict) -> dict:
    tokens = sum(r["tokens"] for r in results)
    tpots = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (r["tokens"] - 1) for r in results
             if r["tokens"] > 1 and len(r["chunk_times"]) > 1]
    gaps = [b - a for r in results for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    delta = {key: after[key] - before[key] for key in before}
    return {
        "requests": len(results), "req_s": len(results) / wall, "out_tok_s": tokens / wall, "tokens": tokens,
        "ttft_p50_ms": 1e3 * statistics.median(r["chunk_times"][0] for r in results if r["chunk_times"]),
        "tpot_p50_ms": 1e3 * statistics.median(tpots) if tpots else None,
        "chunk_gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "chunk_gap_p99_ms": 1e3 * sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else None,
        "acceptance": delta["accepted"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
        "tokens_per_forward": 1 + delta["accepted"] / delta["drafts"] if delta["drafts"] else None,
        **{f"spec_{key}": value for key, value in delta.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--server-args", default="--device cpu" if SMALL else "")
    parser.add_argument("--settings", nargs="+", default=["plain=", f"ngram=--speculative-config '{NGRAM}'"],
                        metavar="NAME=FLAGS")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2] if SMALL else [1, 32])
    parser.add_argument("--requests", type=int, default=2 if SMALL else 64,
                        help="requests per concurrency level (the same paragraphs in every setting)")
    parser.add_argument("--max-tokens", type=int, default=24 if SMALL else 160)
    args = parser.parse_args()
    out = os.environ.get("OUT", ".bench")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    texts = paragraphs(args.requests)
    results, reference = [], {}
    for spec in args.settings:
        name, _, flags = spec.partition("=")
        server = Server(args.model, shlex.split(args.server_args) + shlex.split(flags), name, out, env)
        try:
            log(f"{name}: healthy after {server.wait_healthy(300):.1f} s")
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            asyncio.run(run_level(server.url, model, texts[:2], 2, 8))  # warm-up
            for concurrency in args.concurrency:
                before = spec_counters(server.url)
                outputs, wall = asyncio.run(run_level(server.url, model, texts, concurrency, args.max_tokens))
                row = {"setting": name, "concurrency": concurrency,
                       **summarize(outputs, wall, before, spec_counters(server.url))}
                texts_out = [r["text"] for r in outputs]
                if concurrency in reference:
                    row["same_text"] = sum(a == b for a, b in zip(reference[concurrency], texts_out))
                else:
                    reference[concurrency] = texts_out
                # against the first run (first setting, first concurrency): with bf16 on a GPU, a batch of
                # another size alone can flip a near-tie argmax, so the first setting's own rows are the baseline
                first = reference.setdefault("first", texts_out)
                row["same_text_as_first_run"] = sum(a == b for a, b in zip(first, texts_out))
                results.append(row)
                log(json.dumps(row))
                with open(os.path.join(out, "spec_served.json"), "w") as handle:  # kept if a later run is cut off
                    json.dump(results, handle, indent=1)
        finally:
            server.stop()
    print("\n| setting | concurrency | req/s | out tok/s | TTFT p50 ms | TPOT p50 ms | chunk gap p50 / p99 ms "
          "| acceptance | tokens per forward | texts equal to the first setting's | ... to the first run's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        def fmt(value, spec=".2f"):
            return "-" if value is None else format(value, spec)
        same = row.get("same_text")
        print(f"| {row['setting']} | {row['concurrency']} | {row['req_s']:.2f} | {row['out_tok_s']:.0f} | "
              f"{fmt(row['ttft_p50_ms'], '.1f')} | {fmt(row['tpot_p50_ms'])} | {fmt(row['chunk_gap_p50_ms'])} / "
              f"{fmt(row['chunk_gap_p99_ms'])} | {fmt(row['acceptance'])} | {fmt(row['tokens_per_forward'])} | "
              f"{'-' if same is None else str(same) + '/' + str(row['requests'])} | "
              f"{row['same_text_as_first_run']}/{row['requests']} |")
    with open(os.path.join(out, "spec_served.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
