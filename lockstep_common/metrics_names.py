"""Prometheus names, label values and bucket boundaries shared by the engine, gateway, operator and tests.

Standard library only (no prometheus_client, no torch), so the gateway, the operator and a test can
import it. The rules (docs/ARCHITECTURE.md): prefix `lockstep_`, base units, counters end in `_total`
(the constants below are the exposed names, suffix included; prometheus_client takes a counter's
name with or without it), no request-level labels. vLLM's names, exported unchanged next to ours so
routers and autoscalers built for vLLM read a Lockstep engine as they read vLLM, are in
`lockstep_common.vllm_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterator


def one_two_five(low: float, high: float) -> tuple[float, ...]:
    """The 1-2-5 series between `low` and `high` (both included when on the series), rounded to 6 digits."""
    values = []
    for exponent in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1):
        for mantissa in (1, 2, 5):
            value = float(f"{mantissa * 10.0 ** exponent:.6g}")
            if low * (1 - 1e-9) <= value <= high * (1 + 1e-9):
                values.append(value)
    return tuple(values)


# ---- bucket boundaries ----------------------------------------------------------------------
# Idle gap between forwards, and host phases: 2 us (the CUDA event floor is ~1.3 us) .. 100 ms.
GAP_BUCKETS = one_two_five(2e-6, 0.1)
HOST_PHASE_BUCKETS = one_two_five(2e-6, 1.0)
# GPU time of one forward (+ sample).
STEP_DURATION_BUCKETS = (5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 1.5e-2, 2e-2, 3e-2, 5e-2, 7.5e-2, 0.1, 0.2,
                         0.5, 1.0)
# vLLM's iteration_tokens_total boundaries.
STEP_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Steps a window executed: every length up to 8 is its own bucket, so "all windows ran N" is checkable.
WINDOW_STEPS_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
# vLLM's request histograms, so dashboards built for vLLM port unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
# Finer low end than vLLM's 10 ms first bucket: a decode step of a small model is well under 10 ms.
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1) + REQUEST_LATENCY_BUCKETS


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's prompt/generation length buckets: 1-2-5 up to max_model_len."""
    return tuple(int(b) for b in one_two_five(1, max(max_model_len, 1)))


# ---- label values ---------------------------------------------------------------------------
FINISH_REASONS = ("stop", "length", "abort", "error")

# ---- engine: step timing --------------------------------------------------------------------
STEP_GAP = "lockstep_step_gap_seconds"
GPU_IDLE = "lockstep_gpu_idle_seconds_total"
GPU_BUSY = "lockstep_gpu_busy_seconds_total"
STEP_DURATION = "lockstep_step_duration_seconds"
STEPS = "lockstep_steps_total"
STEP_TOKENS = "lockstep_step_tokens"
WINDOW_STEPS = "lockstep_scheduler_window_steps"
WINDOW_CUTS = "lockstep_scheduler_window_cuts_total"
OVERLAPPED_WINDOWS = "lockstep_scheduler_overlapped_windows_total"
GPU_OCCUPANCY = "lockstep_gpu_occupancy_ratio"
HOST_PHASE = "lockstep_host_phase_seconds"
WASTED_TOKENS = "lockstep_wasted_tokens_total"
STEP_TIMER_INFO = "lockstep_step_timer_info"

# ---- engine: speculative decoding (--speculative-config) -------------------------------------
SPEC_DRAFTS = "lockstep_spec_decode_drafts_total"
SPEC_DRAFT_TOKENS = "lockstep_spec_decode_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "lockstep_spec_decode_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "lockstep_spec_decode_accepted_tokens_per_pos_total"  # label position: 0..K-1
# (name, help, labels) of the four, as the engine declares them
SPEC_DECODE_SERIES = (
    (SPEC_DRAFTS, "Draft proposals: (row, step) pairs of speculative steps whose row proposed tokens", ()),
    (SPEC_DRAFT_TOKENS, "Draft tokens proposed (num_speculative_tokens per proposal)", ()),
    (SPEC_ACCEPTED_TOKENS, "Draft tokens the target accepted (the bonus token not counted)", ()),
    (SPEC_ACCEPTED_PER_POS, "Draft tokens accepted at each draft position", ("position",)),
)

# ---- engine: scheduler, cache, requests -----------------------------------------------------
REQUESTS_RUNNING = "lockstep_requests_running"
REQUESTS_WAITING = "lockstep_requests_waiting"
KV_CACHE_USAGE = "lockstep_kv_cache_usage_ratio"
PREEMPTIONS = "lockstep_preemptions_total"
PREFIX_CACHE_QUERIES = "lockstep_prefix_cache_queries_total"
PREFIX_CACHE_HITS = "lockstep_prefix_cache_hits_total"
PROMPT_TOKENS = "lockstep_prompt_tokens_total"
GENERATION_TOKENS = "lockstep_generation_tokens_total"
REQUESTS_FINISHED = "lockstep_requests_finished_total"
TTFT = "lockstep_time_to_first_token_seconds"
ITL = "lockstep_inter_token_latency_seconds"
E2E_LATENCY = "lockstep_e2e_request_latency_seconds"
QUEUE_TIME = "lockstep_request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = "lockstep_request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "lockstep_request_generation_tokens"

# ---- gateway (declared in lockstep_gateway.metrics; the operator's autoscaler reads the queue depth) ----
GATEWAY_REQUESTS = "lockstep_gateway_requests_total"
GATEWAY_UPSTREAM_LATENCY = "lockstep_gateway_upstream_latency_seconds"
GATEWAY_UPSTREAM_REQUESTS = "lockstep_gateway_upstream_requests_total"
GATEWAY_RETRIES = "lockstep_gateway_retries_total"
GATEWAY_RETRIES_REFUSED = "lockstep_gateway_retries_refused_total"
GATEWAY_BREAKER_OPENED = "lockstep_gateway_breaker_opened_total"
GATEWAY_ADMISSION_REFUSED = "lockstep_gateway_admission_refused_total"
GATEWAY_STREAM_ERRORS = "lockstep_gateway_stream_errors_total"
GATEWAY_UPSTREAM_HEALTHY = "lockstep_gateway_upstream_healthy"
GATEWAY_UPSTREAM_IN_FLIGHT = "lockstep_gateway_upstream_in_flight"
GATEWAY_EJECTIONS = "lockstep_gateway_ejections_total"
GATEWAY_QUEUE_DEPTH = "lockstep_gateway_queue_depth"
GATEWAY_QUEUE_WAIT = "lockstep_gateway_queue_wait_seconds"
GATEWAY_REQUESTS_REFUSED = "lockstep_gateway_requests_refused_total"
GATEWAY_QUEUE_DRAIN_RATE = "lockstep_gateway_queue_drain_rate"
GATEWAY_RATE_LIMITED = "lockstep_gateway_rate_limited_requests_total"

# ---- operator (declared in lockstep_operator.metrics) ---------------------------------------
OPERATOR_RECONCILES = "lockstep_operator_reconciles_total"
OPERATOR_RECONCILE_ERRORS = "lockstep_operator_reconcile_errors_total"
OPERATOR_RECONCILE_DURATION = "lockstep_operator_reconcile_duration_seconds"
OPERATOR_GROUP_RESTARTS = "lockstep_operator_group_restarts_total"
OPERATOR_GROUP_UPDATES = "lockstep_operator_group_updates_total"


def iter_samples(text: str, names: Container[str] | None = None) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample of a Prometheus text exposition as (name, labels, value); comments, timestamps and lines
    that are not a well-formed sample are skipped. With `names`, only those series (the others' labels are
    not even split). The one reader of this text in the project: the gateway's load scrape, the operator's
    autoscaler and the tests.

    Enough for the series this project reads (label values hold no escaped quotes or commas followed by
    `="`), which is what a router reading a few gauges, or a test, needs.
    """
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        labelled = brace != -1 and (space == -1 or brace < space)
        name = line[:brace] if labelled else line[:space] if space != -1 else line
        if names is not None and name not in names:
            continue
        try:
            if labelled:
                body, value = line[brace + 1 :].rsplit("}", 1)
                labels = dict(_split_labels(body))
            else:
                labels, value = {}, line[space + 1 :]
            yield name, labels, float(value.split()[0])
        except (ValueError, IndexError):
            continue


def parse_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text format -> {(name, sorted label pairs): value} (`iter_samples`, in a dict)."""
    return {(name, tuple(sorted(labels.items()))): value for name, labels, value in iter_samples(text)}


def _split_labels(body: str):
    for part in body.split('",'):
        if not part.strip():
            continue
        key, value = part.split("=", 1)
        yield key.strip(), value.strip().strip('"')
