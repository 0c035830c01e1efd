"""Where each process and thread of a served run spends its time, from py-spy's raw (collapsed) stacks.

    py-spy record -r 250 --subprocesses --threads --nonblocking --format raw -o spy.txt -- \
        python3 benchmarks/h200_served.py --model random:smollm2-135m --settings "default=" --client-processes 6
    python3 benchmarks/spy_summary.py spy.txt [--top 15] [--skip warmup]

Per process (its command line, shortened) and thread: samples, and the functions with the most samples
inclusive (anywhere on the stack) and exclusive (the leaf). A stack with a frame matching `--skip` (the
server's warm-up, say) is left out, so the figures are the served run's.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def parse(lines, skip: str | None):
    """{(process, thread): Counter of stacks} from collapsed lines ("frame;frame;... count")."""
    stacks: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        head, _, count = line.rstrip("\n").rpartition(" ")
        if not head or not count.isdigit():
            continue
        frames = head.split(";")
        if skip and any(skip in frame for frame in frames):
            continue
        process = [f for f in frames if f.startswith("process ")][-1:] or ["process ?"]  # the innermost
        process = process[0]
        process = re.sub(r'^process \d+:"', "", process).strip('"').split("\n")[0][:90]
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        calls = tuple(f for f in frames if not f.startswith(("process ", "thread ")))
        stacks[(process, thread)][calls] += int(count)
    return stacks


def function(frame: str) -> str:
    """A frame without its line number: "name (file.py)"."""
    return re.sub(r":\d+\)$", ")", frame)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--skip", default="warmup", help="leave out stacks with a frame containing this ('' keeps all)")
    parser.add_argument("--min-share", type=float, default=0.02, help="leave out threads with a smaller share")
    args = parser.parse_args()
    with open(args.path, errors="replace") as handle:
        # command lines may hold newlines: join continuation lines (they end without a count)
        text = handle.read()
    lines = re.findall(r"process .*? \d+$", text, flags=re.S | re.M)
    stacks = parse(lines, args.skip or None)
    total = sum(sum(c.values()) for c in stacks.values()) or 1
    for (process, thread), counter in sorted(stacks.items(), key=lambda kv: -sum(kv[1].values())):
        samples = sum(counter.values())
        if samples / total < args.min_share:
            continue
        inclusive, exclusive = collections.Counter(), collections.Counter()
        for calls, count in counter.items():
            for name in set(map(function, calls)):
                inclusive[name] += count
            if calls:
                exclusive[function(calls[-1])] += count
        print(f"\n== {process} | {thread}: {samples} samples ({100 * samples / total:.1f}%)")
        print("   inclusive" + " " * 62 + "exclusive")
        rows = zip(inclusive.most_common(args.top), exclusive.most_common(args.top))
        for (a, ca), (b, cb) in rows:
            print(f"   {100 * ca / samples:5.1f}% {a[:64]:64s} {100 * cb / samples:5.1f}% {b[:64]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
