"""lockstep_common.metrics_names.iter_samples: the one reader of Prometheus text (gateway, operator, tests)."""

from __future__ import annotations

from lockstep_common.metrics_names import iter_samples, parse_samples

TEXT = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a b",engine="0"} 3.0
vllm:num_requests_running{model_name="c",engine="0"} 2.0 1700000000000
vllm:num_requests_running_total 99
vllm:num_requests_waiting 4
lockstep_gateway_queue_depth{model="m"} 7
lockstep_gateway_queue_depth{model="n"} 1
broken_line{model="m" 5
not_a_number{model="m"} abc
"""


def test_samples_with_labels_timestamps_and_names_that_share_a_prefix():
    samples = list(iter_samples(TEXT))
    assert ("vllm:num_requests_running", {"model_name": "a b", "engine": "0"}, 3.0) in samples
    assert ("vllm:num_requests_running", {"model_name": "c", "engine": "0"}, 2.0) in samples  # timestamp dropped
    assert ("vllm:num_requests_waiting", {}, 4.0) in samples
    assert ("vllm:num_requests_running_total", {}, 99.0) in samples
    assert not any(name in ("broken_line", "not_a_number") for name, _, _ in samples)  # malformed: skipped


def test_names_select_series_exactly():
    running = [value for _, _, value in iter_samples(TEXT, {"vllm:num_requests_running"})]
    assert running == [3.0, 2.0]  # not the _total series whose name starts the same


def test_the_dict_form_keys_by_sorted_labels():
    samples = parse_samples(TEXT)
    assert samples[("lockstep_gateway_queue_depth", (("model", "m"),))] == 7.0
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "a b")))] == 3.0


def test_the_gateway_and_the_operator_read_through_it():
    from lockstep_gateway.engine_metrics import parse_engine_load
    from lockstep_operator.autoscale import gauge_sum

    load = parse_engine_load(TEXT)
    assert (load.num_running, load.num_waiting) == (5.0, 4.0)
    assert gauge_sum(TEXT, "lockstep_gateway_queue_depth", {"model": "m"}) == 7.0
    assert gauge_sum(TEXT, "lockstep_gateway_queue_depth") == 8.0
    assert gauge_sum(TEXT, "vllm:num_requests_running") == 5.0
