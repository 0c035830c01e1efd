"""vLLM's V1 metric set on a real `lockstep serve`: names, types, labels and buckets as vLLM documents them.

The reference below is copied from vLLM, not from lockstep_common.vllm_metrics, so a drift on either side fails:
source vllm/v1/metrics/loggers.py (`PrometheusStatLogger.__init__`), vLLM v0.11.x
(https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/metrics/loggers.py; the copy read is the one
whose comments say "Deprecated in 0.11 - Renamed as vllm:inter_token_latency_seconds"), and
https://docs.vllm.ai/en/latest/usage/metrics.html. vLLM's deprecated hidden series (gpu_cache_usage_perc,
gpu_prefix_cache_*) and the KV-connector series (no KV transfer here) are left out; the speculative-decoding
counters (vllm/v1/spec_decode/metrics.py, `SpecDecodingProm`) are in.
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lockstep_common import vllm_metrics as v

ENGINE = ("model_name", "engine")
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_TOKENS = "build_1_2_5_buckets(max_model_len)"


def _series(kind: str, labels: tuple[str, ...], buckets, *names: str) -> dict:
    """Series of one type, labels and buckets: name -> (type, label names, buckets)."""
    return {name: (kind, labels, buckets) for name in names}


# name -> (type, label names, buckets); counters by their family name (samples end in _total).
VLLM_V011 = {
    **_series("gauge", ENGINE, None, "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc"),
    **_series("counter", ENGINE, None, "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
              "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens"),
    **_series("counter", (*ENGINE, "finished_reason"), None, "vllm:request_success"),
    **_series("counter", ENGINE, None, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens"),
    **_series("counter", (*ENGINE, "position"), None, "vllm:spec_decode_num_accepted_tokens_per_pos"),
    **_series("histogram", ENGINE, _TOKENS, "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens"),
    **_series("histogram", ENGINE, [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
              "vllm:iteration_tokens_total"),
    **_series("histogram", ENGINE, [1, 2, 5, 10, 20], "vllm:request_params_n"),
    **_series("histogram", ENGINE, [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
              "vllm:time_to_first_token_seconds"),
    **_series("histogram", ENGINE, _ITL, "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    **_series("histogram", ENGINE, _LATENCY, "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds"),
    # Info gauge: CacheConfig.metrics_info() keys + engine (Lockstep's subset of CacheConfig, plus model_name
    # and num_scheduler_steps); only the gauge type and the engine label are compared.
    **_series("gauge", ("engine",), None, "vllm:cache_config_info"),
    **_series("gauge", ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), None,
              "vllm:lora_requests_info"),
}


def _build_1_2_5(max_value: int) -> list[int]:
    """vLLM's build_1_2_5_buckets, restated."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * 10**exponent > max_value:
                return out
            out.append(mantissa * 10**exponent)
        exponent += 1


def _families(server) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text) if family.name.startswith("vllm:")}


def test_the_shared_definition_is_vllms_list():
    ours = {m.name: m for m in v.METRICS}
    assert set(ours) == set(VLLM_V011)
    for name, (kind, labels, buckets) in VLLM_V011.items():
        assert ours[name].kind == kind, name
        assert set(labels) <= set(ours[name].labels), name
        if isinstance(buckets, list):
            assert list(ours[name].buckets) == buckets, name
        elif buckets == _TOKENS:
            assert list(v.buckets_of(ours[name], 1024)) == _build_1_2_5(1024), name


def test_served_names_types_labels_and_buckets_match_vllm(server):
    families = _families(server)
    missing = set(VLLM_V011) - set(families)
    assert not missing, f"not exported: {sorted(missing)}"
    for name, (kind, labels, buckets) in VLLM_V011.items():
        family = families[name]
        assert family.type == kind, f"{name}: {family.type} != {kind}"
        # (one sample per draft position: none from this engine, which runs without --speculative-config)
        assert family.samples or name == "vllm:spec_decode_num_accepted_tokens_per_pos", name
        for sample in family.samples:
            assert set(labels) <= set(sample.labels), f"{name}: labels {sorted(sample.labels)}"
            if "engine" in labels:
                assert sample.labels["engine"] == "0"
            if "model_name" in labels:
                assert sample.labels["model_name"] == server.model
        if buckets is not None:
            expected = _build_1_2_5(1024) if buckets == _TOKENS else buckets
            les = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert les == [float(b) for b in expected] + [float("inf")], name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons >= {"stop", "length", "abort"}  # pre-created at 0, as vLLM's per-reason counters


def test_lora_requests_info_is_there_for_an_endpoint_picker(server):
    """The Gateway API Inference Extension's picker logs errors when vllm:lora_requests_info is missing."""
    family = _families(server)["vllm:lora_requests_info"]
    (sample,) = family.samples
    assert sample.labels == {"max_lora": "0", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert abs(sample.value - time.time()) < 60  # vLLM sets it to the time of the latest update


def test_request_phase_histograms_add_up(server):
    """One greedy request: queue + prefill = TTFT's span and prefill + decode = inference, as vLLM defines them."""

    def totals():
        families = _families(server)
        return {name: next(s.value for s in families[name].samples if s.name.endswith("_sum"))
                for name in (v.REQUEST_QUEUE_TIME, v.REQUEST_PREFILL_TIME, v.REQUEST_DECODE_TIME,
                             v.REQUEST_INFERENCE_TIME, v.E2E_REQUEST_LATENCY)} | {
            "count": next(s.value for s in families[v.REQUEST_INFERENCE_TIME].samples if s.name.endswith("_count")),
            "n": next(s.value for s in families[v.REQUEST_PARAMS_N].samples if s.name.endswith("_sum"))}

    before = totals()
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 24, "ignore_eos": True, "n": 2,
            "temperature": 0.7, "seed": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while (after := totals())["count"] < before["count"] + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    delta = {key: after[key] - before[key] for key in after}
    assert delta["count"] == 1 and delta["n"] == 2
    assert delta[v.REQUEST_PREFILL_TIME] > 0 and delta[v.REQUEST_DECODE_TIME] > 0
    assert abs(delta[v.REQUEST_PREFILL_TIME] + delta[v.REQUEST_DECODE_TIME] - delta[v.REQUEST_INFERENCE_TIME]) < 1e-6
    assert delta[v.REQUEST_QUEUE_TIME] + delta[v.REQUEST_INFERENCE_TIME] <= delta[v.E2E_REQUEST_LATENCY] + 1e-6
