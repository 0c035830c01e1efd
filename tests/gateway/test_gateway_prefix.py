"""Prefix-aware routing: prompt prefix hashes, the per-engine index, the choice on plain data; then
a real gateway over the two real engines keeping a shared prefix on one engine."""

from __future__ import annotations

import random

import httpx
from gateway_harness import MODEL

from lockstep_gateway.routing.candidate import Candidate
from lockstep_gateway.routing.prefix import (
    PREFIX_BLOCK_CHARS,
    PREFIX_BLOCK_TOKENS,
    PREFIX_SLACK_ABS,
    PrefixIndex,
    prefix_hashes,
    prefix_holder,
)

STALE = 3.0


def test_prompts_share_exactly_the_hashes_of_their_common_whole_blocks():
    shared = list(range(100, 100 + 3 * PREFIX_BLOCK_TOKENS))
    first = prefix_hashes({"prompt": shared + [1] * 20}, MODEL)
    second = prefix_hashes({"prompt": shared + [2] * 20}, MODEL)
    assert len(first) == len(second) == 4  # 68 tokens: four whole blocks, the rest is not cached
    assert first[:3] == second[:3] and first[3] != second[3]
    assert prefix_hashes({"prompt": shared}, "another-model")[0] != first[0]
    assert prefix_hashes({"prompt": [shared + [1] * 20, [7] * 32]}, MODEL) == first  # a batch: its first prompt


def test_text_and_chat_prompts_hash_by_characters_and_messages_in_order():
    system = "You are a careful assistant. " * 8
    assert len(prefix_hashes({"prompt": system}, MODEL)) == len(system) // PREFIX_BLOCK_CHARS
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "hello " * 20}]
    later = [*turn, {"role": "assistant", "content": "hi " * 30}, {"role": "user", "content": "more " * 20}]
    first, second = prefix_hashes({"messages": turn}, MODEL), prefix_hashes({"messages": later}, MODEL)
    assert len(second) > len(first) and second[:len(first)] == first  # a later turn extends the prefix
    as_parts = [{"role": "system", "content": [{"type": "text", "text": system}]}, turn[1]]
    assert prefix_hashes({"messages": as_parts}, MODEL) == first
    for payload in ({}, {"prompt": 7}, {"prompt": [1.5] * 40}, {"messages": "hi"}):
        assert prefix_hashes(payload, MODEL) == ()


def test_the_index_matches_leading_blocks_evicts_the_oldest_and_forgets_an_engine():
    index = PrefixIndex(capacity=4)
    index.record("http://a", [1, 2, 3])
    assert index.match("http://a", [1, 2, 3, 4]) == 3
    assert index.match("http://a", [9, 2, 3]) == 0  # chained: a different first block shares nothing
    assert index.match("http://b", [1, 2]) == 0
    index.record("http://a", [7, 8])
    assert index.match("http://a", [1]) == 0 and index.match("http://a", [2, 3]) == 2  # 1 was the oldest
    index.forget("http://a")
    assert index.match("http://a", [2, 3]) == 0


def test_the_prefix_holder_wins_until_it_is_busier_than_the_slack_then_least_load():
    holder, other = Candidate("http://a", in_flight=3), Candidate("http://b", in_flight=0)
    assert prefix_holder([holder, other], [5, 0], STALE) == 0
    overloaded = Candidate("http://a", in_flight=int(PREFIX_SLACK_ABS) + 1)
    assert prefix_holder([overloaded, other], [5, 0], STALE) is None  # then load decides
    longer = Candidate("http://c", in_flight=1)
    assert prefix_holder([holder, other, longer], [5, 0, 6], STALE) == 2
    assert prefix_holder([holder, other], [0, 0], STALE) is None  # no match: load decides


def test_a_gateway_keeps_requests_with_one_prefix_on_one_engine(engines, start_gateway):
    gateway = start_gateway(*[f"--engine={e.url}" for e in engines], "--routing=prefix-aware",
                            expect_healthy={e.url for e in engines})
    shared = [random.Random(7).randrange(10, 1000) for _ in range(8 * PREFIX_BLOCK_TOKENS)]
    for tail in range(6):
        body = {"model": MODEL, "prompt": shared + [tail + 10] * 8, "max_tokens": 1}
        assert httpx.post(gateway.url + "/v1/completions", json=body, timeout=60).status_code == 200
    served = [gateway.metric("lockstep_gateway_upstream_requests_total", engine=e.url, outcome="ok") for e in engines]
    assert sorted(served) == [0, 6], served
