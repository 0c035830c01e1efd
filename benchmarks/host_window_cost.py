"""Host time per window at a full decode batch: what the engine spends in Python between two windows.

Runs `random:tiny` on the CPU (the model is small, so the host work stands out), admits 256 requests
with 200-250-token prompts, runs their prefill windows, then times decode windows with the engine's
own counters (`CoreStats.schedule_s`, `prepare_s`, `output_s`, `update_s`) and prints per-window
medians in ms:

* schedule: `Scheduler.schedule()` (and forking), block reservation included;
* prepare: the window's first-step inputs (`Steps.first_step`: token ids, positions, slots,
  block table, sampling tensors) and block copies;
* output: the core's per-step callback over the window's N steps (each row's token appended, its
  finish code applied, its `SequenceOutput` built); the decode windows are run by `EngineCore.step`
  with an `emit` that only keeps the outputs, so no detokenization is in it;
* update: `EngineCore.step` after the window (row completion, prefix-cache registration, releases);
* send / receive: pickling the window's `StepOutputs` messages as the core process's writer thread
  does (`Connection.send`), and unpickling them and taking their outputs (`StepOutputs.all_outputs`)
  as the API process's client does; outside the core's loop, but the writer shares the loop's GIL.

    PYTHONPATH=.:engine LOCKSTEP_CPU_THREADS=1 python3 benchmarks/host_window_cost.py --windows 30
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import time
from multiprocessing.reduction import ForkingPickler


from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams

FIELDS = ("schedule_s", "prepare_s", "output_s", "update_s", "forward_s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="num_scheduler_steps")
    parser.add_argument("--windows", type=int, default=30, help="decode windows timed")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="overlap, as on CUDA: each window's last step is handed over by the next")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = parser.parse_args()
    # 64 blocks of 16 tokens per sequence are plenty for the timed windows; a smaller cache than the
    # CPU default (2 GiB) makes the reference attention's gathers, and so the benchmark, faster.
    llm = LLM("random:tiny", num_scheduler_steps=args.steps, max_num_seqs=args.batch, max_model_len=2048,
              device="cpu", num_gpu_blocks_override=64 * args.batch, async_scheduling=args.async_scheduling)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1536, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(rng.randint(200, 250))], params)
    core = engine.core
    while core.num_waiting or any(seq.num_computed < seq.num_tokens - 1 for seq in core.scheduler.running):
        engine.step()  # prefill windows
    engine.step()  # the first pure decode window warms up the allocator

    per_window: dict[str, list[float]] = {name: [] for name in (*FIELDS, "send_s", "receive_s")}
    for _ in range(args.windows):
        before = {name: getattr(core.stats, name) for name in FIELDS}
        steps: list = []  # the window's StepOutputs, as the core process's writer gets them
        core.step(steps.append)
        for name in FIELDS:
            per_window[name].append(getattr(core.stats, name) - before[name])
        send_s, receive_s = _pickle_times(steps)
        per_window["send_s"].append(send_s)
        per_window["receive_s"].append(receive_s)
    medians = {name.removesuffix("_s") + "_ms": 1e3 * statistics.median(values) for name, values in per_window.items()}
    medians["host_ms"] = medians["schedule_ms"] + medians["prepare_ms"] + medians["update_ms"]
    if args.json:
        print(json.dumps({"batch": args.batch, "steps": args.steps, "windows": args.windows, **medians}))
        return 0
    print(f"batch {args.batch}, N={args.steps}, {args.windows} decode windows, median ms per window")
    print("| schedule | prepare | update | schedule+prepare+update | output | send | receive | forward (N steps) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {medians['schedule_ms']:.2f} | {medians['prepare_ms']:.2f} | {medians['update_ms']:.2f} | "
          f"{medians['host_ms']:.2f} | {medians['output_ms']:.2f} | {medians['send_ms']:.2f} | "
          f"{medians['receive_ms']:.2f} | {medians['forward_ms']:.0f} |")
    return 0


def _pickle_times(messages: list) -> tuple[float, float]:
    """Seconds to pickle the messages as `Connection.send` does, and to unpickle and read them."""
    started = time.perf_counter()
    payloads = [ForkingPickler.dumps(message) for message in messages]
    pickled = time.perf_counter()
    for payload in payloads:
        for _ in pickle.loads(payload).all_outputs():  # as the API's client reads a step
            pass
    return pickled - started, time.perf_counter() - pickled


if __name__ == "__main__":
    raise SystemExit(main())
