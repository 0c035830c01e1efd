"""Routing as filters, scorers and a picker, on plain candidate snapshots: each filter, each scorer, the
picker, and each policy of the registry put to work by a `Router`."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lockstep_gateway.config import ROUTING_POLICIES, ConfigError, GatewayConfig
from lockstep_gateway.main import parse_args
from lockstep_gateway.routing import filters
from lockstep_gateway.routing.affinity import HashRing, SessionAffinity
from lockstep_gateway.routing.candidate import Ask, Candidate, EngineLoad, Incoming, Settings
from lockstep_gateway.routing.kv_cache import KVCacheHeadroom
from lockstep_gateway.routing.picker import add_scores, pick, runaway
from lockstep_gateway.routing.prefix import PREFIX_BLOCK_TOKENS, PrefixCache
from lockstep_gateway.routing.registry import POLICIES, build_policy
from lockstep_gateway.routing.router import Router
from lockstep_gateway.routing.scorers import LeastLoad, RoundRobin

MODEL = "m"
SETTINGS = Settings(stale_after_s=3.0, queue_depth=8, max_in_flight=0, session_affinity=False)
ASK = Ask(MODEL)
PROMPT = list(range(100, 100 + 4 * PREFIX_BLOCK_TOKENS))


def engine(name: str, **fields) -> Candidate:
    return Candidate(f"http://{name}", models=(MODEL,), **fields)


def scraped(name: str, running: float = 0, waiting: float = 0, kv: float = 0.0, **fields) -> Candidate:
    return engine(name, load=EngineLoad(running, waiting, kv), load_age_s=0.1, **fields)


def urls(candidates) -> list[str]:
    return [c.url.removeprefix("http://") for c in candidates]


def router(name: str, affinity: bool = False, seed: int = 0) -> Router:
    settings = Settings(stale_after_s=3.0, queue_depth=8, session_affinity=affinity)
    return Router(build_policy(name, settings), settings, random.Random(seed))


def hints(chosen: Router, payload: dict, headers: dict | None = None) -> dict:
    return chosen.read(Incoming(MODEL, payload, headers or {}, generation=True))


# ---- filters ---------------------------------------------------------------------------------------------
def test_serving_model_keeps_healthy_engines_of_the_model():
    pool = [engine("a"), engine("down", healthy=False), Candidate("http://other", models=("n",))]
    assert urls(filters.serving_model(pool, ASK, SETTINGS)) == ["a"]


def test_breaker_allows_drops_engines_whose_breaker_is_open():
    pool = [engine("a", breaker_allows=False), engine("b")]
    assert urls(filters.breaker_allows(pool, ASK, SETTINGS)) == ["b"]


def test_confident_takes_a_suspect_engine_only_when_nothing_else_is_left():
    assert urls(filters.confident([engine("a", suspect=True), engine("b")], ASK, SETTINGS)) == ["b"]
    assert urls(filters.confident([engine("a", suspect=True)], ASK, SETTINGS)) == ["a"]


def test_untried_drops_the_engines_a_request_was_sent_to():
    pool = [engine("a"), engine("b"), engine("c")]
    assert urls(filters.untried(pool, Ask(MODEL, tried=frozenset({"http://b"})), SETTINGS)) == ["a", "c"]


def test_unsaturated_drops_an_engine_whose_queue_reached_the_depth():
    pool = [scraped("full", waiting=8), scraped("room", waiting=7), engine("open", in_flight=8, seats=0)]
    assert urls(filters.unsaturated(pool, ASK, SETTINGS)) == ["room"]  # 8 open on an engine never seen running


# ---- scorers ---------------------------------------------------------------------------------------------
def test_least_load_scores_the_negated_load():
    assert LeastLoad().score([engine("a", in_flight=2), scraped("b", running=1, waiting=3)], ASK, SETTINGS) \
        == [-2.0, -(4 + 3)]


def test_round_robin_gives_the_turn_to_each_engine_in_url_order():
    scorer, pool = RoundRobin(), [engine("c"), engine("a"), engine("b")]
    turns = [urls(pool)[scores.index(1.0)] for scores in (scorer.score(pool, ASK, SETTINGS) for _ in range(6))]
    assert turns == ["b", "c", "a"] * 2


def test_prefix_cache_scores_the_engine_it_sent_the_prefix_to_and_forgets_it():
    scorer, pool = PrefixCache(), [engine("a"), engine("b")]
    prefix = scorer.read(Incoming(MODEL, {"prompt": PROMPT}, {}, generation=True))
    assert scorer.read(Incoming(MODEL, {"prompt": PROMPT}, {}, generation=False)) is None  # e.g. /tokenize
    ask = Ask(MODEL, {scorer.name: prefix})
    assert scorer.score(pool, ask, SETTINGS) == [0.0, 0.0]
    scorer.routed("http://b", prefix)
    assert scorer.score(pool, ask, SETTINGS) == [0.0, 1.0]
    scorer.forget("http://b")  # restarted: its cache is gone
    assert scorer.score(pool, ask, SETTINGS) == [0.0, 0.0]


def test_prefix_cache_gives_nothing_to_a_holder_busier_than_the_slack():
    scorer, pool = PrefixCache(), [engine("a", in_flight=20), engine("b")]
    prefix = scorer.read(Incoming(MODEL, {"prompt": PROMPT}, {}, generation=True))
    scorer.routed("http://a", prefix)
    assert scorer.score(pool, Ask(MODEL, {scorer.name: prefix}), SETTINGS) == [0.0, 0.0]


def test_session_affinity_scores_the_first_candidate_on_the_keys_ring():
    scorer, pool = SessionAffinity("x-session-id"), [engine(f"e{i}") for i in range(4)]
    key = scorer.read(Incoming(MODEL, {"user": "u1"}, {"x-session-id": "s1"}, generation=True))
    assert key == "h:s1"
    order = HashRing([c.url for c in pool]).preference(key)
    scores = scorer.score(pool, Ask(MODEL, {scorer.name: key}), SETTINGS)
    assert pool[scores.index(1.0)].url == order[0] and sum(scores) == 1.0
    rest = [c for c in pool if c.url != order[0]]  # its engine filtered out: the next one on the ring
    scores = scorer.score(rest, Ask(MODEL, {scorer.name: key}, offered=tuple(c.url for c in pool)), SETTINGS)
    assert rest[scores.index(1.0)].url == order[1]
    assert scorer.score(pool, ASK, SETTINGS) == [0.0] * 4  # no key: no preference


def test_kv_cache_headroom_scores_free_cache_in_tenths_and_nothing_without_a_fresh_scrape():
    pool = [scraped("a", kv=0.0), scraped("b", kv=0.25), scraped("c", kv=0.9),
            engine("stale", load=EngineLoad(kv_cache_usage=0.0), load_age_s=60.0), engine("never")]
    assert KVCacheHeadroom().score(pool, ASK, SETTINGS) == [1.0, 0.7, 0.1, 0.0, 0.0]


# ---- picker ----------------------------------------------------------------------------------------------
def test_scores_add_up_weighted_per_candidate():
    totals = [0.0, 0.0, 0.0]
    add_scores(totals, 2.0, [1.0, 0.0, 0.5])
    add_scores(totals, 1.0, [0.0, 1.0, 1.0])
    assert totals == [2.0, 1.0, 2.0]


def test_a_lead_larger_than_the_weight_still_to_come_decides_early():
    assert runaway([2.0, 0.0, 0.0], weight_to_come=1.0) == 0
    assert runaway([1.0, 0.0], weight_to_come=1.0) is None  # the next scorer may still tie it
    assert runaway([0.0, 0.0], weight_to_come=0.0) is None  # equals: the picker's draw
    assert runaway([0.0], weight_to_come=5.0) == 0


def test_the_highest_weighted_sum_wins_whatever_the_tie_break_says():
    pool = [engine("a"), engine("b")]
    assert pick(pool, [0.0, 1.0], [10.0, -10.0], random.Random(0)).url == "http://b"


def test_among_equal_sums_two_are_drawn_and_the_better_tie_break_wins():
    pool = [engine(f"e{i}") for i in range(4)]
    rng = random.Random(1)
    picks = Counter(pick(pool, [0.0] * 4, [0.0, -1.0, -2.0, -3.0], rng).url for _ in range(2000))
    assert "http://e3" not in picks  # the worst of four loses every draw it is in
    assert picks["http://e0"] > picks["http://e1"] > picks["http://e2"] > 0
    assert {pick(pool[:2], [1.0, 1.0], [-5.0, -1.0], rng).url for _ in range(50)} == {"http://e1"}


# ---- policies --------------------------------------------------------------------------------------------
def test_the_registry_names_the_routing_flags_values_and_every_policy_builds():
    assert ROUTING_POLICIES == tuple(POLICIES) and "prefix-aware" in POLICIES and "kv-cache" in POLICIES
    for name in POLICIES:
        assert router(name).choose([engine("a")], ASK).url == "http://a"
        assert router(name).choose([engine("a", healthy=False)], ASK) is None


def test_least_load_takes_the_lighter_of_two():
    light, heavy = engine("a", in_flight=1), engine("b", in_flight=5)
    chosen = router("least-load")
    assert {chosen.choose([heavy, light], ASK).url for _ in range(30)} == {"http://a"}


def test_round_robin_turns_over_the_engines_that_may_take_the_request():
    chosen = router("round-robin")
    pool = [engine("a"), engine("b"), engine("c", healthy=False)]
    assert [chosen.choose(pool, ASK).url for _ in range(4)] == ["http://b", "http://a"] * 2


def test_prefix_aware_keeps_a_prefix_on_the_engine_it_went_to_until_that_engine_is_forgotten():
    chosen = router("prefix-aware", seed=3)
    pool = [engine(f"e{i}") for i in range(4)]
    ask = Ask(MODEL, hints(chosen, {"prompt": PROMPT + [1]}))
    first = chosen.choose(pool, ask)
    chosen.routed(first.url, ask.hints)
    for tail in range(2, 12):
        assert chosen.choose(pool, Ask(MODEL, hints(chosen, {"prompt": PROMPT + [tail]}))).url == first.url
    chosen.forget(first.url)
    assert len({chosen.choose(pool, ask).url for _ in range(40)}) > 1  # load decides again


def test_kv_cache_prefers_free_cache_over_fewer_requests_and_load_among_equal_tenths():
    chosen = router("kv-cache")
    roomy, full = scraped("roomy", running=6, kv=0.2), scraped("full", running=1, kv=0.85)
    assert {chosen.choose([full, roomy], ASK).url for _ in range(20)} == {"http://roomy"}
    busy, idle = scraped("busy", running=6, kv=0.21), scraped("idle", running=1, kv=0.28)  # both 0.7 free
    assert {chosen.choose([busy, idle], ASK).url for _ in range(20)} == {"http://idle"}


def test_session_affinity_sticks_a_key_to_one_engine_and_falls_back_when_it_is_filtered_out():
    chosen = router("prefix-aware", affinity=True)
    pool = [engine(f"e{i}") for i in range(4)]
    ask = Ask(MODEL, hints(chosen, {"prompt": PROMPT}, {"x-session-id": "s1"}))
    sticky = chosen.choose(pool, ask).url
    chosen.routed(sticky, ask.hints)
    assert {chosen.choose(pool, ask).url for _ in range(20)} == {sticky}
    saturated = [engine(c.url.removeprefix("http://"), in_flight=8) if c.url == sticky else c for c in pool]
    fallback = chosen.choose(saturated, ask).url
    assert fallback != sticky and {chosen.choose(saturated, ask).url for _ in range(20)} == {fallback}
    assert chosen.choose(pool, ask).url == sticky  # back once it has room


def test_a_session_request_leaves_the_round_robin_turn_where_it_was():
    chosen = router("round-robin", affinity=True)
    pool = [engine("a"), engine("b"), engine("c")]
    keyless, keyed = Ask(MODEL), Ask(MODEL, hints(chosen, {}, {"x-session-id": "s1"}))
    turns = []
    for _ in range(3):
        turns.append(chosen.choose(pool, keyless).url)
        chosen.choose(pool, keyed)
    assert turns == ["http://b", "http://c", "http://a"]


def test_session_affinity_outweighs_the_policys_own_scorers():
    policy = build_policy("prefix-aware", Settings(session_affinity=True))
    (affinity, weight), *others = policy.scorers
    assert isinstance(affinity, SessionAffinity) and weight > sum(w for _, w in others)
    assert not any(isinstance(s, SessionAffinity) for s, _ in build_policy("prefix-aware", SETTINGS).scorers)


def test_a_bad_routing_value_names_the_flag_the_value_and_the_allowed_ones(capsys):
    with pytest.raises(ConfigError, match=r"--routing='fastest' .* least-load \| round-robin \| prefix-aware"):
        GatewayConfig(routing="fastest")
    with pytest.raises(SystemExit):
        parse_args(["--routing", "fastest"])
    assert "--routing: invalid choice: 'fastest'" in capsys.readouterr().err
