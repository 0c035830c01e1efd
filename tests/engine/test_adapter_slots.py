"""LoRA adapters on the scheduler's side (plain Python): the slot table, admission, plans that load slots,
the plan codec carrying them to a group's workers, and prefix-cache roots per adapter."""

import pytest

from lockstep_engine.adapter_slots import AdapterNotFound, AdapterSlots
from lockstep_engine.block_manager import BlockManager
from lockstep_engine.group.plan_codec import PlanDecoder, PlanEncoder
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.scheduler import Scheduler, SchedulerLimits
from lockstep_engine.sequence import Request, SequenceStatus


def make_scheduler(max_loras: int, num_blocks: int = 64, block_size: int = 4):
    adapters = AdapterSlots(max_loras, max_cpu_loras=4)
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, num_scheduler_steps=4,
                             scheduling_policy="fcfs")
    return Scheduler(limits, blocks, adapters=adapters), adapters


def request(rid: str, adapter=None, prompt=(1, 2, 3, 4, 5, 6, 7, 8, 9)) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=4), 256, 0)
    r.adapter = adapter
    return r


def finish(scheduler, seq) -> None:
    scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)


def test_a_batch_holds_at_most_max_loras_adapters_and_a_freed_slot_is_loaded_in_the_next_plan():
    scheduler, adapters = make_scheduler(max_loras=1)
    a, b = adapters.register("a", "/adapters/a"), adapters.register("b", "/adapters/b")
    ra, rb, base = request("ra", a), request("rb", b), request("base")
    for r in (ra, rb, base):
        scheduler.add_request(r)
    plan = scheduler.schedule()
    admitted = {row.seq.request.request_id: row.seq.lora_slot for row in plan.rows}
    assert admitted == {"ra": 1, "base": 0}  # b waits for the only slot; the base model needs none
    assert plan.lora_loads == [(1, "a", "/adapters/a")]
    assert [seq.request.request_id for seq in scheduler.waiting] == ["rb"]
    assert adapters.active() == ["a"]
    assert scheduler.schedule().lora_loads == []  # a stays loaded: nothing to load again
    finish(scheduler, ra.sequences[0])
    assert ra.sequences[0].lora_slot == 0 and adapters.active() == []
    plan = scheduler.schedule()
    assert {row.seq.request.request_id: row.seq.lora_slot for row in plan.rows} == {"rb": 1, "base": 0}
    assert plan.lora_loads == [(1, "b", "/adapters/b")]


def test_two_slots_take_two_adapters_and_the_least_recently_used_free_slot_is_reused():
    scheduler, adapters = make_scheduler(max_loras=2)
    a, b, c = (adapters.register(n, f"/adapters/{n}") for n in "abc")
    ra, rb = request("ra", a), request("rb", b)
    scheduler.add_request(ra)
    scheduler.add_request(rb)
    plan = scheduler.schedule()
    assert sorted(plan.lora_loads) == [(1, "a", "/adapters/a"), (2, "b", "/adapters/b")]
    finish(scheduler, ra.sequences[0])
    rc = request("rc", c)
    scheduler.add_request(rc)
    plan = scheduler.schedule()
    assert rc.sequences[0].lora_slot == 1 and plan.lora_loads == [(1, "c", "/adapters/c")]
    ra2 = request("ra2", a)  # a was evicted from slot 1: it is loaded again, into the slot b leaves
    scheduler.add_request(ra2)
    finish(scheduler, rb.sequences[0])
    plan = scheduler.schedule()
    assert ra2.sequences[0].lora_slot == 2 and plan.lora_loads == [(2, "a", "/adapters/a")]


def test_preemption_gives_the_slot_back():
    scheduler, adapters = make_scheduler(max_loras=1)
    a = adapters.register("a", "/adapters/a")
    ra = request("ra", a)
    scheduler.add_request(ra)
    scheduler.schedule()
    scheduler._preempt(ra.sequences[0])
    assert ra.sequences[0].lora_slot == 0 and adapters.active() == []
    assert scheduler.schedule().rows[0].seq.lora_slot == 1


def test_registry_errors_name_the_adapter_and_unregistering_keeps_requests_in_flight():
    adapters = AdapterSlots(1, max_cpu_loras=2)
    a = adapters.register("a", "/adapters/a")
    with pytest.raises(ValueError, match="'a' has already been loaded"):
        adapters.register("a", "/elsewhere")
    adapters.register("b", "/adapters/b")
    with pytest.raises(ValueError, match="--max-cpu-loras=2"):
        adapters.register("c", "/adapters/c")
    with pytest.raises(AdapterNotFound, match="The model `zzz` does not exist"):
        adapters.resolve("zzz")
    assert adapters.resolve("a") is a and adapters.resolve(None) is None
    assert adapters.unregister("a") is a
    assert adapters.acquire(a) == 1  # a request that arrived with it still gets a slot
    assert adapters.listing() == [("b", "/adapters/b")]
    with pytest.raises(ValueError, match="bad files"):
        adapters.load("d", "/adapters/d", check=lambda name, path: (_ for _ in ()).throw(ValueError("bad files")))
    assert "d" not in adapters.registered


def test_prefix_blocks_of_one_adapter_never_serve_another_or_the_base_model():
    scheduler, adapters = make_scheduler(max_loras=2)
    a, b = adapters.register("a", "/adapters/a"), adapters.register("b", "/adapters/b")
    prompt = tuple(range(1, 14))
    first = request("first", a, prompt)
    scheduler.add_request(first)
    plan = scheduler.schedule()
    seq = first.sequences[0]
    seq.num_computed = plan.rows[0].num_new_tokens
    scheduler.blocks.register_computed_blocks(seq)
    assert seq.num_hashed_blocks >= 2
    hits = {}
    for name, adapter in (("same", a), ("other", b), ("base", None)):
        r = request(name, adapter, prompt)
        hits[name] = scheduler.blocks.allocate_cached_prefix(r.sequences[0])
    assert hits["same"] == 12 and hits["other"] == 0 and hits["base"] == 0
    again = adapters.unregister("a")
    renewed = adapters.register("a", "/adapters/a-v2")  # the same name, new weights: a new root
    assert renewed.adapter_id != again.adapter_id
    assert scheduler.blocks.allocate_cached_prefix(request("renewed", renewed, prompt).sequences[0]) == 0


def test_the_plan_codec_carries_each_rows_slot_and_the_windows_loads_to_a_worker():
    scheduler, adapters = make_scheduler(max_loras=2)
    a = adapters.register("a", "/adapters/a")
    for r in (request("ra", a), request("base")):
        scheduler.add_request(r)
    plan = scheduler.schedule()
    mirrored = PlanDecoder().decode(PlanEncoder().encode(plan))
    assert mirrored.lora_loads == plan.lora_loads == [(1, "a", "/adapters/a")]
    assert [(r.seq.request.request_id, r.seq.lora_slot) for r in mirrored.rows] == \
        [(r.seq.request.request_id, r.seq.lora_slot) for r in plan.rows] == [("ra", 1), ("base", 0)]


def test_the_samples_of_an_n_request_forked_while_running_keep_its_adapters_slot():
    scheduler, adapters = make_scheduler(max_loras=1)
    a = adapters.register("a", "/adapters/a")
    r = Request("r", list(range(1, 10)), SamplingParams(max_tokens=4, n=3), 256, 0)
    r.adapter = a
    scheduler.add_request(r)
    plan = scheduler.schedule()
    parent = r.sequences[0]
    parent.num_computed = plan.rows[0].num_new_tokens
    scheduler.fork_ready_requests([r])
    assert [seq.lora_slot for seq in r.sequences] == [1, 1, 1]
    for seq in r.sequences:
        finish(scheduler, seq)
    assert adapters.active() == []  # every sample gave the slot back
