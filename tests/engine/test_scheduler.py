"""Scheduler on plain Python data: windows, chunked prefill, seats, preemption, auto window length."""

from lockstep_engine.block_manager import BlockManager
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import Scheduler, SchedulerLimits
from lockstep_engine.sequence import Request, SequenceStatus


def _scheduler(num_blocks=64, steps=8, max_seqs=8, budget=64, block_size=4, policy="fcfs", max_wait=2.0,
               clock=lambda: 0.0, long_threshold=0, max_long=1):
    limits = SchedulerLimits(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512,
                             num_scheduler_steps=steps, scheduling_policy=policy, lof_max_wait_s=max_wait,
                             long_prefill_token_threshold=long_threshold, max_long_partial_prefills=max_long)
    return Scheduler(limits, BlockManager(num_blocks, block_size), clock=clock)


def _request(name, prompt_len, max_tokens=32, n=1, arrival=0.0, priority=0):
    return Request(name, list(range(prompt_len)), SamplingParams(n=n, max_tokens=max_tokens, priority=priority),
                   512, seed=0, arrival_time=arrival)


def _finish_window(scheduler, plan, tokens=1):
    for row in plan.rows:
        if row.samples:
            row.seq.token_ids += [7] * row.max_steps
        scheduler.complete_row(row, row.max_steps if row.samples else 0)


def test_a_window_reserves_lookahead_for_every_step():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 10))
    plan = scheduler.schedule()
    [row] = plan.rows
    assert plan.num_steps == 8 and row.num_new_tokens == 10 and row.samples and row.max_steps == 8
    # 10 prompt tokens + 7 more written by steps 2..8 = 17 slots = 5 blocks of 4
    assert len(row.seq.block_ids) == 5


def test_max_steps_bounded_by_remaining_tokens():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 10, max_tokens=3))
    [row] = scheduler.schedule().rows
    assert row.max_steps == 3 and row.remaining_tokens == 3  # carried to the device's length budget


def test_chunked_prefill_splits_a_long_prompt_and_decodes_ride_along():
    scheduler = _scheduler(budget=16)
    scheduler.add_request(_request("short", 4, arrival=0.0))
    scheduler.add_request(_request("long", 40, arrival=1.0))
    plan = scheduler.schedule()
    assert [(r.seq.request.request_id, r.num_new_tokens, r.samples) for r in plan.rows] == [
        ("short", 4, True), ("long", 12, False)]
    _finish_window(scheduler, plan)
    plan = scheduler.schedule()
    assert [(r.seq.request.request_id, r.num_new_tokens) for r in plan.rows] == [("short", 1), ("long", 15)]


def _chunks(plan) -> list[tuple[str, int, bool]]:
    return [(r.seq.request.request_id, r.num_new_tokens, r.samples) for r in plan.rows]


def test_a_long_prompt_computes_at_most_the_threshold_per_step_beside_a_decoding_stream():
    """Under a budget of 64, a 40-token prompt would be one step; over the threshold of 12 it is four
    chunks of at most 12 tokens, so the stream beside it gets a token after every 12-token step."""
    scheduler = _scheduler(budget=64, long_threshold=12)
    scheduler.add_request(_request("stream", 4))
    _finish_window(scheduler, scheduler.schedule())
    # no prefix shared with the stream's prompt
    scheduler.add_request(Request("long", list(range(100, 140)), SamplingParams(max_tokens=32), 512, seed=0))
    chunks = []
    for _ in range(4):
        plan = scheduler.schedule()
        assert _chunks(plan)[0] == ("stream", 1, True)
        chunks.append(_chunks(plan)[1])
        _finish_window(scheduler, plan)
    assert chunks == [("long", 12, False), ("long", 12, False), ("long", 12, False), ("long", 4, True)]


def test_a_prompt_at_the_threshold_is_not_cut_and_zero_turns_the_cap_off():
    for threshold, expected in ((40, [("a", 40, True)]), (0, [("a", 40, True)]), (39, [("a", 39, False)])):
        scheduler = _scheduler(long_threshold=threshold)
        scheduler.add_request(_request("a", 40))
        assert _chunks(scheduler.schedule()) == expected, threshold


def test_one_long_prompt_is_partly_computed_at_a_time_and_the_queue_behind_it_waits():
    """max_long_partial_prefills=1: the second long prompt (and the short one queued after it) starts
    once the first has its last chunk; with 2, both long prompts take a chunk in the same step."""
    scheduler = _scheduler(budget=64, long_threshold=10)
    for name, length in (("long1", 25), ("long2", 25), ("short", 3)):
        scheduler.add_request(_request(name, length))
    seen = []
    for _ in range(3):
        plan = scheduler.schedule()
        seen.append(_chunks(plan))
        _finish_window(scheduler, plan)
    assert seen[0] == [("long1", 10, False)]
    assert seen[1] == [("long1", 10, False)]
    # long1's last chunk is no longer long: long2 may start, and short after it
    assert seen[2] == [("long1", 5, True), ("long2", 10, False), ("short", 3, True)]
    scheduler = _scheduler(budget=64, long_threshold=10, max_long=2)
    for name, length in (("long1", 25), ("long2", 25), ("short", 3)):
        scheduler.add_request(_request(name, length))
    assert _chunks(scheduler.schedule()) == [("long1", 10, False), ("long2", 10, False), ("short", 3, True)]


def test_max_num_seqs_limits_admission():
    scheduler = _scheduler(max_seqs=2)
    for name in "abc":
        scheduler.add_request(_request(name, 4))
    plan = scheduler.schedule()
    assert len(plan.rows) == 2 and scheduler.num_waiting == 1


def test_latest_arrival_is_preempted_when_blocks_run_out():
    scheduler = _scheduler(num_blocks=9, steps=4)
    scheduler.add_request(_request("old", 12, arrival=0.0))
    scheduler.add_request(_request("new", 12, arrival=1.0))
    plan = scheduler.schedule()
    assert len(plan.rows) == 2  # 15 slots each = 4 blocks each
    _finish_window(scheduler, plan)
    plan = scheduler.schedule()  # each now needs 19 slots = 5 blocks, and 1 is free
    assert [r.seq.request.request_id for r in plan.rows] == ["old"]
    assert scheduler.num_preemptions == 1 and scheduler.waiting[0].request.request_id == "new"
    assert scheduler.waiting[0].num_computed == 0 and scheduler.waiting[0].block_ids == []


def test_lof_admits_the_largest_max_tokens_first_and_fcfs_by_arrival():
    lengths = {"a": 5, "b": 50, "c": 20, "d": 50}
    for policy, expected in (("fcfs", ["a", "b", "c"]), ("lof", ["b", "d", "c"])):
        scheduler = _scheduler(max_seqs=3, policy=policy)
        for arrival, (name, max_tokens) in enumerate(lengths.items()):
            scheduler.add_request(_request(name, 4, max_tokens=max_tokens, arrival=float(arrival)))
        plan = scheduler.schedule()
        # equal max_tokens (b, d) keep their arrival order
        assert [r.seq.request.request_id for r in plan.rows] == expected
        assert [seq.request.request_id for seq in scheduler.waiting] == [n for n in lengths if n not in expected]


def test_lof_puts_a_preempted_sequence_ahead_of_fresh_ones():
    scheduler = _scheduler(num_blocks=9, steps=4, policy="lof")
    scheduler.add_request(_request("old", 12, max_tokens=100, arrival=0.0))
    scheduler.add_request(_request("new", 12, max_tokens=90, arrival=1.0))
    plan = scheduler.schedule()
    assert [r.seq.request.request_id for r in plan.rows] == ["old", "new"]
    scheduler.add_request(_request("longest", 4, max_tokens=400, arrival=2.0))
    _finish_window(scheduler, plan)
    plan = scheduler.schedule()  # blocks run short: "new" is preempted, and waits ahead of "longest"
    assert [r.seq.request.request_id for r in plan.rows] == ["old"] and scheduler.num_preemptions == 1
    assert [seq.request.request_id for seq in scheduler.waiting] == ["new", "longest"]


def test_priority_admits_the_lowest_priority_value_first_then_by_arrival():
    priorities = {"a": 5, "b": -3, "c": 0, "d": -3, "e": 2**63 - 1}
    scheduler = _scheduler(max_seqs=3, policy="priority")
    for arrival, (name, priority) in enumerate(priorities.items()):
        scheduler.add_request(_request(name, 4, arrival=float(arrival), priority=priority))
    plan = scheduler.schedule()
    assert [r.seq.request.request_id for r in plan.rows] == ["b", "d", "c"]  # ties (b, d) by arrival
    assert [seq.request.request_id for seq in scheduler.waiting] == ["a", "e"]
    # A later, more urgent request goes ahead of everything still waiting; fcfs ignores priorities.
    scheduler.add_request(_request("urgent", 4, arrival=9.0, priority=-100))
    assert [seq.request.request_id for seq in scheduler.waiting] == ["urgent", "a", "e"]
    fcfs = _scheduler(max_seqs=3, policy="fcfs")
    for arrival, (name, priority) in enumerate(priorities.items()):
        fcfs.add_request(_request(name, 4, arrival=float(arrival), priority=priority))
    assert [r.seq.request.request_id for r in fcfs.schedule().rows] == ["a", "b", "c"]


def test_priority_preempts_the_least_urgent_running_request_and_requeues_it_by_priority():
    scheduler = _scheduler(num_blocks=9, steps=4, policy="priority")
    # "urgent" arrives last: under fcfs it would be the one preempted.
    scheduler.add_request(_request("relaxed", 12, arrival=0.0, priority=10))
    scheduler.add_request(_request("urgent", 12, arrival=1.0, priority=-1))
    plan = scheduler.schedule()
    assert [r.seq.request.request_id for r in plan.rows] == ["urgent", "relaxed"]
    scheduler.add_request(_request("middle", 4, arrival=2.0, priority=5))
    _finish_window(scheduler, plan)
    plan = scheduler.schedule()  # each needs a fifth block, one is free: "relaxed" goes
    assert [r.seq.request.request_id for r in plan.rows] == ["urgent"] and scheduler.num_preemptions == 1
    assert [seq.request.request_id for seq in scheduler.waiting] == ["middle", "relaxed"]
    assert scheduler.waiting[1].num_computed == 0 and scheduler.waiting[1].block_ids == []


def test_priority_engine_serves_the_most_urgent_first_with_the_same_greedy_tokens(tiny):
    from lockstep_engine.llm import LLM

    prompts = [[3 + i, 40 + i, 200 + 7 * i] for i in range(4)]
    priorities = [3, 1, 2, 0]
    results = {}
    for policy in ("fcfs", "priority"):
        llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=4, max_num_seqs=1,
                  scheduling_policy=policy)
        engine, finished, tokens = llm.engine, [], {}
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, priority=q),
                                  arrival_time=1.0 + i) for i, (p, q) in enumerate(zip(prompts, priorities))]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append(ids.index(out.request_id))
                    tokens[out.request_id] = out.outputs[0].token_ids
        results[policy] = [tokens[i] for i in ids], finished
    assert results["fcfs"][1] == [0, 1, 2, 3]
    assert results["priority"][1] == [3, 1, 2, 0]  # one seat: served in priority order
    assert results["priority"][0] == results["fcfs"][0]


def test_a_long_prompt_chunked_by_the_threshold_gives_the_greedy_tokens_of_one_step(tiny):
    """A 150-token prompt beside a decoding stream, with 16 prompt tokens a step at most and without a
    cap: the same greedy tokens for both requests."""
    from lockstep_engine.llm import LLM

    long_prompt = [(13 * i) % 900 + 5 for i in range(150)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = {}
    for threshold in (0, 16):
        llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=8, long_prefill_token_threshold=threshold)
        engine, tokens, prompt_steps = llm.engine, {}, []
        ids = [engine.add_request([4, 8, 15, 16, 23], greedy)]
        engine.step()
        ids.append(engine.add_request(long_prompt, greedy))
        while engine.has_unfinished_requests():
            before = engine.core.stats.num_prompt_tokens_computed
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            prompt_steps.append(engine.core.stats.num_prompt_tokens_computed - before)
        results[threshold] = [tokens[i] for i in ids]
        assert max(prompt_steps) == (150 if threshold == 0 else 16)
    assert results[16] == results[0]


def _run_window(scheduler, plan):
    """Every sampling row decodes its window's tokens; rows at their limit finish."""
    _finish_window(scheduler, plan)
    for row in plan.rows:
        if row.samples and row.seq.remaining_tokens <= 0:
            scheduler.finish(row.seq, SequenceStatus.FINISHED_LENGTH)


def test_lof_admits_a_short_request_behind_a_stream_of_long_ones_within_its_wait_bound():
    for max_wait, admitted_at in ((1.0, 11), (float("inf"), None)):
        now = [0.0]
        scheduler = _scheduler(steps=4, max_seqs=1, policy="lof", max_wait=max_wait, clock=lambda now=now: now[0])
        scheduler.add_request(_request("short", 4, max_tokens=2, arrival=0.0))
        admitted = None
        for window in range(50):  # 0.1 s per window; a longer request arrives before each
            scheduler.add_request(_request(f"long{window}", 4, max_tokens=4, arrival=now[0]))
            plan = scheduler.schedule()
            [row] = plan.rows
            if row.seq.request.request_id == "short":
                admitted = window
                break
            _run_window(scheduler, plan)
            now[0] += 0.1
        # the first window after it waited more than 1 s (10 windows of 0.1 s, and float rounding)
        assert admitted == admitted_at, (max_wait, admitted)


def test_lof_orders_aged_requests_by_arrival_ahead_of_fresh_longer_ones():
    now = [0.0]
    scheduler = _scheduler(max_seqs=8, budget=4, policy="lof", max_wait=2.0, clock=lambda: now[0])
    for name, arrival, max_tokens in (("b", 0.5, 10), ("a", 0.0, 5), ("c", 1.0, 20)):
        scheduler.add_request(_request(name, 4, max_tokens=max_tokens, arrival=arrival))
    assert [seq.request.request_id for seq in scheduler.waiting] == ["c", "b", "a"]
    now[0] = 2.7  # a and b waited more than 2 s, c not yet
    scheduler.add_request(_request("fresh", 4, max_tokens=400, arrival=2.7))
    plan = scheduler.schedule()  # a budget of 4 tokens admits one
    assert [row.seq.request.request_id for row in plan.rows] == ["a"]
    assert [seq.request.request_id for seq in scheduler.waiting] == ["b", "fresh", "c"]


def test_lof_counts_a_request_without_max_tokens_as_long_as_max_model_len_allows():
    scheduler = _scheduler(max_seqs=1, policy="lof")
    scheduler.add_request(_request("bounded", 4, max_tokens=400))
    scheduler.add_request(_request("unbounded", 4, max_tokens=None))  # 512 - 4 tokens left
    assert [row.seq.request.request_id for row in scheduler.schedule().rows] == ["unbounded"]


def test_n_samples_prefill_once_then_fork():
    scheduler = _scheduler()
    request = _request("a", 10, n=3)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    [row] = plan.rows
    assert row.num_new_tokens == 9 and not row.samples  # the last prompt token is computed per sample
    _finish_window(scheduler, plan)
    scheduler.fork_ready_requests([request])
    assert len(request.sequences) == 3
    plan = scheduler.schedule()
    assert [r.num_new_tokens for r in plan.rows] == [1, 1, 1] and all(r.samples for r in plan.rows)
    # the shared block with the last prompt slot was copied for two of the three samples
    assert len(plan.block_copies) == 2


def test_complete_rows_advances_every_row_registers_filled_blocks_and_counts_waste():
    scheduler = _scheduler(budget=16)
    for name, prompt_len in (("early", 4), ("full", 4), ("chunk", 40)):
        scheduler.add_request(_request(name, prompt_len))
    scheduler.waiting[0].token_ids[:4] = [9] * 4  # early's prompt block is not full's
    plan = scheduler.schedule()
    early, full, chunk = plan.rows
    assert (early.samples, full.samples, chunk.samples, chunk.num_new_tokens) == (True, True, False, 8)
    early.seq.token_ids += [7, 7]  # sampled 2 of the 8 steps, then stopped
    early.seq.status = SequenceStatus.FINISHED_STOPPED
    full.seq.token_ids += [7] * 8
    assert scheduler.complete_rows(plan.rows, [2, 8, 0], 8) == 6  # early's 6 steps after its stop
    assert (early.seq.num_computed, full.seq.num_computed, chunk.seq.num_computed) == (5, 11, 8)
    # every running row's full computed blocks enter the prefix cache; the finished row's wait for its release
    assert (early.seq.num_hashed_blocks, full.seq.num_hashed_blocks, chunk.seq.num_hashed_blocks) == (0, 2, 2)
    scheduler.finish(early.seq, early.seq.status)
    again = _request("again", 4)
    again.sequences[0].token_ids[:] = [9, 9, 9, 9, 7, 7]
    assert early.seq.block_ids == [] and scheduler.blocks.allocate_cached_prefix(again.sequences[0]) == 4


def test_auto_shrinks_with_waiting_requests_and_grows_in_steady_decode():
    scheduler = _scheduler(steps="auto", max_seqs=1)
    scheduler.add_request(_request("a", 4, max_tokens=200))
    scheduler.add_request(_request("b", 4, max_tokens=200))
    first = scheduler.schedule()
    assert first.num_steps <= 2  # "b" is waiting
    _finish_window(scheduler, first)
    scheduler.waiting.clear()
    lengths = []
    for _ in range(4):
        plan = scheduler.schedule()
        lengths.append(plan.num_steps)
        _finish_window(scheduler, plan)
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]


def test_lof_engine_gives_fcfs_tokens_and_starts_long_requests_first(tiny):
    from lockstep_engine.llm import LLM

    prompts = [[3 + i, 40 + i, 200 + 7 * i] for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 17, 6, 25, 9)]
    results = {}
    for policy in ("fcfs", "lof"):
        llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps=4, max_num_seqs=2,
                  scheduling_policy=policy)
        engine, started, tokens = llm.engine, [], {}
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in started:
                    started.append(out.request_id)
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        results[policy] = [tokens[i] for i in ids], [ids.index(r) for r in started]
    (fcfs_tokens, fcfs_started), (lof_tokens, lof_started) = results["fcfs"], results["lof"]
    assert [len(t) for t in lof_tokens] == [3, 17, 6, 25, 9]
    assert lof_tokens == fcfs_tokens  # greedy tokens do not depend on the admission order
    # two seats: fcfs starts requests 0 and 1, lof the two largest max_tokens (25 and 17)
    assert sorted(fcfs_started[:2]) == [0, 1] and sorted(lof_started[:2]) == [1, 3]


def test_auto_with_waiting_requests_keeps_the_boundary_a_small_share_of_the_window():
    from lockstep_engine.scheduler import (AUTO_BOUNDARY_SHARE, AUTO_COST_SAMPLES, AUTO_MAX_STEPS,
                                           AUTO_WAITING_STEPS)

    scheduler = _scheduler(steps="auto", max_seqs=1)
    for name in "abc":
        scheduler.add_request(_request(name, 4, max_tokens=200))
    plan = scheduler.schedule()
    assert plan.num_steps == AUTO_WAITING_STEPS  # nothing measured yet
    _finish_window(scheduler, plan)
    # 4 ms idle at a boundary, 8 ms a step: 10 steps keep the idle time at 5% of the window
    scheduler.observe_costs(boundary_gap_s=0.004, decode_step_s=0.008)
    assert AUTO_BOUNDARY_SHARE == 0.05
    plan = scheduler.schedule()
    assert plan.num_steps == 10
    _finish_window(scheduler, plan)
    # medians of recent measurements: one outlier (a warm-up boundary) does not move them
    scheduler.observe_costs(boundary_gap_s=0.003)
    scheduler.observe_costs(boundary_gap_s=0.5)
    plan = scheduler.schedule()
    assert plan.num_steps == 10  # median boundary 4 ms
    _finish_window(scheduler, plan)
    for _ in range(AUTO_COST_SAMPLES):
        scheduler.observe_costs(boundary_gap_s=1.0, decode_step_s=0.001)
    assert scheduler.schedule().num_steps == AUTO_MAX_STEPS


def test_auto_engine_learns_costs_from_its_step_timings(tiny):
    from lockstep_engine.llm import LLM

    llm = LLM("random:tiny", share_model_with=tiny, num_scheduler_steps="auto", max_num_seqs=2)
    prompts = [{"prompt_token_ids": [5 + i, 9, 13 + i]} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 6
    scheduler = llm.engine.core.scheduler
    assert scheduler._boundary_s and min(scheduler._decode_step_s) > 0


def test_auto_window_is_not_cut_short_by_a_row_about_to_end():
    scheduler = _scheduler(steps="auto", max_seqs=2)
    scheduler.add_request(_request("a", 4, max_tokens=3))
    scheduler.add_request(_request("b", 4, max_tokens=40))
    first = scheduler.schedule()
    assert first.num_steps == 2 and len(first.rows) == 2  # requests were waiting when it was planned
    _finish_window(scheduler, first)
    plan = scheduler.schedule()  # "a" has 1 token left, "b" 38
    assert plan.num_steps == 4
    assert {row.seq.request.request_id: row.max_steps for row in plan.rows} == {"a": 1, "b": 4}


def test_priority_over_http_is_accepted_under_its_policy_and_a_bad_value_is_a_400_naming_it():
    import sys
    from pathlib import Path

    import openai

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
    from api_harness import Server

    server = Server("random:tiny", "--scheduling-policy", "priority", "--num-gpu-blocks-override", "64",
                    "--skip-warmup", name="priority")
    try:
        client = server.wait_healthy().client()
        for priority in (-5, 0, 2**63 - 1):
            done = client.completions.create(model="random:tiny", prompt=[1, 2, 3], max_tokens=3,
                                             extra_body={"priority": priority, "ignore_eos": True})
            assert done.choices[0].finish_reason == "length"
        for bad in ("high", 1.5, 2**63, -(2**63) - 1):
            try:
                client.completions.create(model="random:tiny", prompt=[1, 2, 3], max_tokens=3,
                                          extra_body={"priority": bad})
            except openai.BadRequestError as error:
                assert error.body["param"] == "priority", error.body
                if isinstance(bad, int):  # past int64: the message gives the value and the range
                    assert str(bad) in error.body["message"] and str(2**63 - 1) in error.body["message"]
            else:
                raise AssertionError(f"priority={bad!r} was accepted")
    finally:
        server.stop()
