"""The block table built from the previous window's (`BlockTables`) equals one built from scratch, window
after window, on the leader's sequences and on a worker's mirrors, through forks, copy-on-write,
preemption (new blocks for a recomputed sequence), prefix-cache hits, stops and aborts."""

import random

from lockstep_engine.block_manager import BlockManager
from lockstep_engine.group.plan_codec import PlanDecoder, PlanEncoder
from lockstep_engine.runner.step_inputs import BlockTables, pad_rows
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import Scheduler, SchedulerLimits
from lockstep_engine.sequence import Request, SequenceStatus

SINK = 999
VOCAB = 1000


def test_incremental_tables_match_tables_built_from_scratch():
    rng = random.Random(3)
    blocks = BlockManager(20, 4, enable_prefix_caching=True)  # small: preemption happens
    scheduler = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512,
                                          num_scheduler_steps=4), blocks)
    prefixes = [[rng.randrange(VOCAB) for _ in range(8)] for _ in range(2)]  # shared: prefix cache hits
    encoder, decoder = PlanEncoder(), PlanDecoder()
    leader_tables, worker_tables = BlockTables(SINK), BlockTables(SINK)
    requests: list[Request] = []
    seen = {"copy": False, "fork": False, "preemption": False, "kept": False}
    for window in range(400):
        if len(requests) < 60 and rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
            params = SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(2, 30))
            request = Request(f"r{len(requests)}", prompt, params, 512, seed=1, arrival_time=window)
            requests.append(request)
            scheduler.add_request(request)
        scheduler.fork_ready_requests([r for r in requests if not r.forked])
        plan = scheduler.schedule()
        if plan is None:
            continue
        decoded = decoder.decode(encoder.encode(plan))
        seen["kept"] |= any(row.seq in leader_tables._index for row in plan.rows)
        for tables, rows in ((leader_tables, plan.rows), (worker_tables, decoded.rows)):
            table = tables.build(rows)
            assert table.tolist() == pad_rows([row.seq.block_ids for row in rows], SINK).tolist()
        seen["copy"] |= bool(plan.block_copies)
        seen["fork"] |= any(row.seq.index > 0 for row in plan.rows)
        seen["preemption"] |= scheduler.num_preemptions > 0
        for row in plan.rows:  # the device's part: every sampling row samples its max_steps
            seq = row.seq
            if row.samples:
                seq.token_ids += [rng.randrange(VOCAB) for _ in range(row.max_steps)]
            scheduler.complete_row(row, row.max_steps if row.samples else 0)
            if row.samples and (seq.remaining_tokens <= 0 or rng.random() < 0.05):
                scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert all(seen.values()), seen
