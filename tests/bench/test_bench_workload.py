"""The sharegpt-synth workload and Poisson arrivals: pure functions on plain data."""

from __future__ import annotations

import math

import pytest

from lockstep.bench.workload import (
    WorkloadRequest,
    describe,
    is_valid_sequence,
    poisson_arrivals,
    sharegpt_synth,
)


@pytest.fixture(scope="module")
def default_workload() -> list[WorkloadRequest]:
    return sharegpt_synth(num_prompts=1000, seed=0)


def test_same_seed_gives_the_same_workload(default_workload):
    assert sharegpt_synth(num_prompts=1000, seed=0) == default_workload


def test_other_seed_gives_another_workload(default_workload):
    assert sharegpt_synth(num_prompts=1000, seed=1) != default_workload


def test_fewer_prompts_are_a_prefix_of_more():
    assert sharegpt_synth(num_prompts=50, seed=3) == sharegpt_synth(num_prompts=200, seed=3)[:50]


def test_lengths_do_not_depend_on_vocab_size():
    small = sharegpt_synth(num_prompts=100, vocab_size=32000)
    large = sharegpt_synth(num_prompts=100, vocab_size=128256)
    assert [(r.prompt_len, r.output_len) for r in small] == [(r.prompt_len, r.output_len) for r in large]


def test_every_request_passes_the_sharegpt_filter(default_workload):
    for request in default_workload:
        assert 4 <= request.prompt_len <= 1024
        assert request.output_len >= 4
        assert request.prompt_len + request.output_len <= 2048


def test_means_match_sharegpt_within_ten_percent(default_workload):
    stats = describe(default_workload)
    assert stats["num_requests"] == 1000
    assert stats["mean_prompt_len"] == pytest.approx(225, rel=0.10)
    assert stats["mean_output_len"] == pytest.approx(200, rel=0.10)


def test_output_lengths_have_a_long_tail(default_workload):
    stats = describe(default_workload)
    assert 1500 <= stats["max_output_len"] <= 1800
    median_output = sorted(r.output_len for r in default_workload)[500]
    assert median_output < stats["mean_output_len"]


def test_token_ids_stay_in_the_safe_range():
    workload = sharegpt_synth(num_prompts=200, vocab_size=5000)
    token_ids = [t for r in workload for t in r.prompt_token_ids]
    assert min(token_ids) >= 1000
    assert max(token_ids) < 5000


def test_filter_matches_vllm_bounds():
    assert is_valid_sequence(4, 4)
    assert is_valid_sequence(1024, 1024)
    assert not is_valid_sequence(3, 100)
    assert not is_valid_sequence(100, 3)
    assert not is_valid_sequence(1025, 10)
    assert not is_valid_sequence(1024, 1025)


def test_vocab_size_below_the_safe_range_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        sharegpt_synth(num_prompts=1, vocab_size=1000)


def test_describe_reports_totals_means_and_maxima():
    requests = [WorkloadRequest([1, 2, 3, 4], 10), WorkloadRequest([5] * 6, 20)]
    assert describe(requests) == {
        "num_requests": 2,
        "total_prompt_tokens": 10,
        "total_output_tokens": 30,
        "mean_prompt_len": 5.0,
        "mean_output_len": 15.0,
        "max_prompt_len": 6,
        "max_output_len": 20,
    }


def test_infinite_rate_sends_everything_at_once():
    assert poisson_arrivals(5, math.inf, seed=0) == [0.0] * 5


def test_poisson_arrivals_have_the_requested_mean_rate():
    delays = poisson_arrivals(20000, rate=4.0, seed=0)
    assert delays[0] == 0.0
    assert all(d >= 0 for d in delays)
    assert sum(delays) / (len(delays) - 1) == pytest.approx(0.25, rel=0.03)
    assert poisson_arrivals(100, 4.0, seed=0) == delays[:100]


def test_nonpositive_rate_is_rejected():
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)
