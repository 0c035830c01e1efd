"""What a burst's intake costs a rate-inf run of a small model: a scheduler-only model.

The real `Scheduler` and `BlockManager` on the sharegpt-synth workload (seed 0, 1000 requests), with a clock
that a device-time model advances instead of a GPU. A step costs 1.0 ms + 3.3 us per row + 1.3 us per
prompt token: random:smollm2-135m's decode steps and graphed prefill on an H100 (docs/BENCHMARKS.md, the
decode profile and the served runs' forwards). Overlap is assumed perfect (no gap between windows).

The requests reach the core in a random order spread evenly over `--spreads` seconds (how long the API
took to take the burst). Printed per spread and policy: the run's length, and for its longest request
(1765 tokens) when it reached the core, how long it waited for a seat, and when it ended. A model, not a
measurement: its steps are cheaper than the device's, so compare its rows with each other.

    PYTHONPATH=.:engine python benchmarks/burst_intake_model.py [--spreads 0 0.5 1 1.5 --seeds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics

from lockstep.bench.workload import make_workload
from lockstep_engine.block_manager import BlockManager
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import Scheduler, SchedulerLimits
from lockstep_engine.sequence import Request, SequenceStatus


def step_s(rows: int, prompt_tokens: int) -> float:
    return 1.0e-3 + 3.3e-6 * rows + 1.3e-6 * prompt_tokens


def simulate(policy: str, spread: float, seed: int, num: int = 1000, steps: int = 8, budget: int = 8192,
             seats: int = 256) -> dict:
    workload = make_workload("sharegpt-synth", num, seed=0, vocab_size=32000)
    now = [0.0]
    limits = SchedulerLimits(max_num_seqs=seats, max_num_batched_tokens=budget, max_model_len=8192,
                             num_scheduler_steps=steps, scheduling_policy=policy)
    scheduler = Scheduler(limits, BlockManager(200000, 16), clock=lambda: now[0])
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, spread) for _ in workload)
    order = list(range(num))
    rng.shuffle(order)
    arrivals = list(zip(times, order))
    longest = f"r{max(range(num), key=lambda i: workload[i].output_len)}"
    requests, seated, sent = {}, {}, 0
    while sent < num or scheduler.has_work():
        while sent < num and arrivals[sent][0] <= now[0]:
            at, index = arrivals[sent]
            item = workload[index]
            request = Request(f"r{index}", item.prompt_token_ids,
                              SamplingParams(max_tokens=item.output_len, ignore_eos=True), 8192, 0, arrival_time=at)
            requests[request.request_id] = request
            scheduler.add_request(request)
            sent += 1
        plan = scheduler.schedule()
        if plan is None:
            now[0] = arrivals[sent][0]
            continue
        rows = plan.sampling_rows
        first = step_s(len(plan.rows), sum(row.num_new_tokens for row in plan.rows))
        for row in plan.rows:
            seated.setdefault(row.seq.request.request_id, now[0])
            if row.samples:
                row.seq.token_ids += [5] * row.max_steps
            scheduler.complete_row(row, row.max_steps if row.samples else 0)
        now[0] += first + (plan.num_steps - 1) * step_s(len(rows), 0)
        for row in rows:
            if row.seq.remaining_tokens <= 0 and not row.seq.is_finished:
                if row.seq.request.request_id == longest:
                    ended = now[0]
                scheduler.finish(row.seq, SequenceStatus.FINISHED_LENGTH)
    arrived = requests[longest].arrival_time
    return {"run_s": now[0], "arrived_s": arrived, "seat_wait_s": seated[longest] - arrived, "ended_s": ended}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5])
    parser.add_argument("--seeds", type=int, default=5, help="arrival orders per spread")
    parser.add_argument("--policies", nargs="+", default=["lof", "fcfs"])
    args = parser.parse_args()
    print("| spread s | policy | run s (median, range) | longest: reached the core s | its seat wait s | "
          "ended - reached s |")
    print("|---|---|---|---|---|---|")
    for spread in args.spreads:
        for policy in args.policies:
            runs = [simulate(policy, spread, seed) for seed in range(1, args.seeds + 1)]
            lengths = [r["run_s"] for r in runs]
            reached = ", ".join(f"{r['arrived_s']:.2f}" for r in runs)
            after = ", ".join(f"{r['ended_s'] - r['arrived_s']:.2f}" for r in runs)
            wait = max(r["seat_wait_s"] for r in runs)
            print(f"| {spread} | {policy} | {statistics.median(lengths):.2f} ({min(lengths):.2f}-{max(lengths):.2f}) | "
                  f"{reached} | {wait:.2f} max | {after} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
