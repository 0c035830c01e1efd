"""Routing decisions on plain data: least-load with power-of-two choices, round robin, consistent hashing."""

from __future__ import annotations

import random
from collections import Counter

from lockstep_gateway.engine_metrics import parse_engine_load
from lockstep_gateway.routing.affinity import HashRing, session_key
from lockstep_gateway.routing.candidate import Ask, Candidate, EngineLoad, Settings, is_saturated, load_score
from lockstep_gateway.routing.picker import pick
from lockstep_gateway.routing.scorers import LeastLoad, next_in_turn

STALE = 3.0


def pick_least_load(candidates, stale_after_s, rng):
    """Power of two choices by load: the picker with no preference scores."""
    loads = LeastLoad().score(candidates, Ask("m"), Settings(stale_after_s=stale_after_s))
    return pick(candidates, [0.0] * len(candidates), loads, rng)


def test_power_of_two_choices_always_takes_the_lighter_of_two_engines():
    light = Candidate("http://a", in_flight=1)
    heavy = Candidate("http://b", in_flight=9)
    rng = random.Random(0)
    assert {pick_least_load([light, heavy], STALE, rng).url for _ in range(50)} == {"http://a"}


def test_least_load_never_picks_the_heaviest_of_many():
    candidates = [Candidate(f"http://e{i}", in_flight=i) for i in range(5)]
    rng = random.Random(1)
    picks = Counter(pick_least_load(candidates, STALE, rng).url for _ in range(2000))
    assert "http://e4" not in picks
    assert picks["http://e0"] > picks["http://e1"] > picks["http://e2"] > picks["http://e3"]


def test_fresh_engine_queues_count_and_stale_ones_are_ignored():
    queued = EngineLoad(num_running=4, num_waiting=10, kv_cache_usage=0.9)
    assert load_score(Candidate("http://a", 2, queued, load_age_s=0.5), STALE) == 14 + 10 + 0.9
    assert load_score(Candidate("http://a", 2, queued, load_age_s=10.0), STALE) == 2
    busy_elsewhere = Candidate("http://a", 0, queued, load_age_s=0.1)  # another gateway's traffic
    idle = Candidate("http://b", 1, EngineLoad(), load_age_s=0.1)
    assert pick_least_load([busy_elsewhere, idle], STALE, random.Random(0)).url == "http://b"


def test_saturation_by_queue_depth_or_in_flight_limit():
    waiting = Candidate("http://a", 0, EngineLoad(num_waiting=8), load_age_s=0.1)
    assert is_saturated(waiting, STALE, queue_depth=8, max_in_flight=0)
    assert not is_saturated(waiting, STALE, queue_depth=9, max_in_flight=0)
    assert not is_saturated(Candidate("http://a", 0, EngineLoad(num_waiting=8), load_age_s=9), STALE, 8, 0)
    assert is_saturated(Candidate("http://a", 3), STALE, queue_depth=0, max_in_flight=3)
    assert not is_saturated(Candidate("http://a", 300), STALE, queue_depth=0, max_in_flight=0)


def test_round_robin_cycles_in_a_stable_order():
    candidates = [Candidate("http://b"), Candidate("http://a"), Candidate("http://c")]
    assert [next_in_turn([c.url for c in candidates], i) for i in range(6)] == ["http://a", "http://b", "http://c"] * 2


def test_hash_ring_is_stable_and_moves_only_the_keys_of_a_leaving_engine():
    members = [f"http://e{i}" for i in range(4)]
    ring = HashRing(members)
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: ring.preference(k)[0] for k in keys}
    assert before == {k: HashRing(list(reversed(members))).preference(k)[0] for k in keys}
    shares = Counter(before.values())
    assert all(350 <= n <= 650 for n in shares.values()), shares
    smaller = HashRing(members[:3])
    after = {k: smaller.preference(k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "http://e3" for k in moved)
    # the fallback order is the ring order: a key of the missing engine goes to its next choice
    assert all(after[k] == ring.preference(k)[1] for k in moved)


def test_session_key_prefers_the_header_then_the_user_field():
    assert session_key({"x-session-id": "s1"}, {"user": "u1"}, "X-Session-Id") == "h:s1"
    assert session_key({}, {"user": "u1"}, "x-session-id") == "u:u1"
    assert session_key({}, {"user": ""}, "x-session-id") is None
    assert session_key({}, {}, "x-session-id") is None


def test_engine_load_is_read_from_vllm_gauges():
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="n"} 1.0 1700000000000
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:cache_config_info{block_size="16"} 1.0
lockstep_steps_total 99.0
"""
    assert parse_engine_load(text) == EngineLoad(num_running=3.0, num_waiting=3.0, kv_cache_usage=0.25)
    assert parse_engine_load("lockstep_steps_total 1.0\n") is None
