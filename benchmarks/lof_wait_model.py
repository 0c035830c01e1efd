"""How the lof wait bound (`--lof-max-wait`) moves a burst's run time and TTFT: a scheduler-only model.

The real `Scheduler` and `BlockManager` on the sharegpt-synth workload (seed 0), with a clock that a
device-time model advances instead of a GPU: a step costs 4.8 ms + 33 us per row + 32 us per prefill
token (run 6's decode roofline on the H200, Llama-3-8B bf16; prefill at about 500 TFLOP/s) and a window
boundary 3 ms. A model, not a measurement of the engine: it shows which bounds leave lof's admission
order of the long requests alone, before device time is spent on them.

    PYTHONPATH=.:engine python benchmarks/lof_wait_model.py
"""

from __future__ import annotations

import random

from lockstep.bench.workload import make_workload
from lockstep_engine.block_manager import BlockManager
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import Scheduler, SchedulerLimits
from lockstep_engine.sequence import Request, SequenceStatus

BOUNDARY_S = 3e-3


def step_s(rows: int, tokens: int) -> float:
    return 4.8e-3 + 0.033e-3 * rows + 0.032e-3 * tokens


def simulate(policy: str, max_wait: float, rate: float | None = None, num: int = 1000, steps: int = 8,
             budget: int = 2048, seats: int = 256) -> tuple[float, float, float]:
    """(run time s, TTFT p50 s, TTFT p99 s) of the workload under one setting."""
    workload = make_workload("sharegpt-synth", num, seed=0, vocab_size=32000)
    now = [0.0]
    limits = SchedulerLimits(max_num_seqs=seats, max_num_batched_tokens=budget, max_model_len=8192,
                             num_scheduler_steps=steps, scheduling_policy=policy, lof_max_wait_s=max_wait)
    scheduler = Scheduler(limits, BlockManager(50000, 16), clock=lambda: now[0])
    rng, arrival, arrivals = random.Random(1), 0.0, []
    for _ in workload:
        arrivals.append(arrival)
        arrival += rng.expovariate(rate) if rate else 0.0
    requests, first, sent = {}, {}, 0
    while sent < num or scheduler.has_work():
        while sent < num and arrivals[sent] <= now[0]:
            w = workload[sent]
            request = Request(f"r{sent}", w.prompt_token_ids, SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                              8192, 0, arrival_time=arrivals[sent])
            requests[request.request_id] = request
            scheduler.add_request(request)
            sent += 1
        plan = scheduler.schedule()
        if plan is None:
            now[0] = arrivals[sent]
            continue
        rows = plan.sampling_rows
        first_step = step_s(len(plan.rows), sum(r.num_new_tokens for r in plan.rows))
        for row in plan.rows:
            if row.samples:
                first.setdefault(row.seq.request.request_id, now[0] + first_step)
                row.seq.token_ids += [5] * row.max_steps
            scheduler.complete_row(row, row.max_steps if row.samples else 0)
        now[0] += first_step + (plan.num_steps - 1) * step_s(len(rows), 0) + BOUNDARY_S
        for row in rows:
            if row.seq.remaining_tokens <= 0 and not row.seq.is_finished:
                scheduler.finish(row.seq, SequenceStatus.FINISHED_LENGTH)
    ttft = sorted(first[r] - requests[r].arrival_time for r in requests)
    return now[0], ttft[len(ttft) // 2], ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]


def main() -> None:
    for policy, wait in (("fcfs", 0.0), ("lof", float("inf")), ("lof", 20), ("lof", 10), ("lof", 5), ("lof", 2),
                         ("lof", 1)):
        run, p50, p99 = simulate(policy, wait)
        print(f"{policy} bound {wait}: rate inf, 1000 requests: {run:.1f} s ({1000 / run:.1f} req/s), "
              f"TTFT p50 {p50:.2f} s, p99 {p99:.2f} s")
    for rate in (10, 25):
        for policy, wait in (("fcfs", 0.0), ("lof", float("inf")), ("lof", 2)):
            _, p50, p99 = simulate(policy, wait, rate=rate, num=400)
            print(f"{policy} bound {wait}: Poisson {rate} req/s, 400 requests: TTFT p50 {p50 * 1e3:.0f} ms, "
                  f"p99 {p99 * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
