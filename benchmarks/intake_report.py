"""When a rate-inf burst's requests got their first token, against their length: how long the server took to
take the burst in, from the client's side.

At rate inf every request is sent at once, and the engine seats the longest first (`lof`): a long request
that has reached the engine core gets a seat within a window, so its time to first token is about when it
reached the core. The first tokens of the longest requests, spread over the burst, show how long the
intake took; the run cannot end before the longest request's first token plus its own decode.

Reads the per-request files `benchmarks/h200_served.py` writes ($OUT/requests_<label>.json: output lengths,
TTFTs and end-to-end seconds in the client's order) and prints one line per file:

    python3 benchmarks/intake_report.py $OUT/requests_*.json [--top 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def report(path: str, top: int) -> str:
    with open(path) as handle:
        data = json.load(handle)
    lengths, ttfts, e2els = data["output_lens"], data["ttfts"], data["e2els"]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    longest = order[0]
    top_ttfts = sorted(ttfts[i] for i in order[:top])
    quantiles = statistics.quantiles(top_ttfts, n=10) if len(top_ttfts) >= 2 else top_ttfts
    label = os.path.basename(path).removeprefix("requests_").removesuffix(".json")
    return (f"{label}: {len(lengths)} requests; longest ({lengths[longest]} tokens) first token {ttfts[longest]:.2f} s, "
            f"last {e2els[longest]:.2f} s ({(e2els[longest] - ttfts[longest]) / max(lengths[longest] - 1, 1) * 1e3:.2f} "
            f"ms a token after it); the {len(top_ttfts)} longest: first tokens {top_ttfts[0]:.2f}-{top_ttfts[-1]:.2f} s "
            f"(p10 {quantiles[0]:.2f}, p50 {statistics.median(top_ttfts):.2f}, p90 {quantiles[-1]:.2f}); "
            f"all: first tokens p50 {statistics.median(ttfts):.2f} s, run {max(e2els):.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--top", type=int, default=50, help="how many of the longest requests to summarise")
    args = parser.parse_args()
    for path in args.paths:
        print(report(path, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
