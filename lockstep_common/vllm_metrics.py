"""vLLM's V1 Prometheus metric set, as a Lockstep engine exports it beside its `lockstep_` series.

One definition for the engine (lockstep_engine.metrics renders from it), the docs and the tests.
Names, types, label names and buckets are vLLM's (vllm/v1/metrics/loggers.py, `PrometheusStatLogger`,
v0.11), so dashboards, autoscalers and routers built for vLLM (the Gateway API Inference Extension's
endpoint picker reads `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and
`vllm:lora_requests_info`) read a Lockstep engine unchanged. Standard library only.

`alias` names the `lockstep_` series whose observations a vLLM series shares (same meaning and
buckets, observed once, written under both names); the others are observed for the vLLM name.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep_common import metrics_names as n

ENGINE_LABELS = ("model_name", "engine")  # every vLLM engine series; engine is the index, "0" here
ENGINE_INDEX = "0"
FINISHED_REASONS = ("stop", "length", "abort")  # str(vllm.v1.engine.FinishReason)

# vLLM's bucket lists (loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
TOKENS = "tokens"  # buckets: vLLM's build_1_2_5_buckets(max_model_len), fixed once the model is loaded


@dataclass(frozen=True)
class VllmMetric:
    name: str  # the family name (a counter's samples add _total)
    kind: str  # gauge | counter | histogram
    help: str  # vLLM's documentation string
    labels: tuple[str, ...] = ENGINE_LABELS
    buckets: tuple[float, ...] | str = ()
    alias: str | None = None  # the lockstep_ series it shares observations with


# ---- names ----------------------------------------------------------------------------------
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = "vllm:time_per_output_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_INFERENCE_TIME = "vllm:request_inference_time_seconds"
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"

METRICS: tuple[VllmMetric, ...] = (
    VllmMetric(NUM_REQUESTS_RUNNING, "gauge", "Number of requests in model execution batches."),
    VllmMetric(NUM_REQUESTS_WAITING, "gauge", "Number of requests waiting to be processed."),
    VllmMetric(KV_CACHE_USAGE, "gauge", "KV-cache usage. 1 means 100 percent usage."),
    VllmMetric(PREFIX_CACHE_QUERIES, "counter", "Prefix cache queries, in terms of number of queried tokens.",
               alias=n.PREFIX_CACHE_QUERIES),
    VllmMetric(PREFIX_CACHE_HITS, "counter", "Prefix cache hits, in terms of number of cached tokens.",
               alias=n.PREFIX_CACHE_HITS),
    VllmMetric(NUM_PREEMPTIONS, "counter", "Cumulative number of preemption from the engine.", alias=n.PREEMPTIONS),
    VllmMetric(PROMPT_TOKENS, "counter", "Number of prefill tokens processed.", alias=n.PROMPT_TOKENS),
    VllmMetric(GENERATION_TOKENS, "counter", "Number of generation tokens processed.", alias=n.GENERATION_TOKENS),
    VllmMetric(REQUEST_SUCCESS, "counter", "Count of successfully processed requests.",
               (*ENGINE_LABELS, "finished_reason")),
    VllmMetric(REQUEST_PROMPT_TOKENS, "histogram", "Number of prefill tokens processed.", buckets=TOKENS,
               alias=n.REQUEST_PROMPT_TOKENS),
    VllmMetric(REQUEST_GENERATION_TOKENS, "histogram", "Number of generation tokens processed.", buckets=TOKENS,
               alias=n.REQUEST_GENERATION_TOKENS),
    VllmMetric(ITERATION_TOKENS, "histogram", "Histogram of number of tokens per engine_step.",
               buckets=ITERATION_TOKENS_BUCKETS, alias=n.STEP_TOKENS),
    VllmMetric(REQUEST_MAX_NUM_GENERATION_TOKENS, "histogram",
               "Histogram of maximum number of requested generation tokens.", buckets=TOKENS),
    VllmMetric(REQUEST_PARAMS_N, "histogram", "Histogram of the n request parameter.", buckets=PARAMS_N_BUCKETS),
    VllmMetric(REQUEST_PARAMS_MAX_TOKENS, "histogram", "Histogram of the max_tokens request parameter.",
               buckets=TOKENS),
    VllmMetric(TIME_TO_FIRST_TOKEN, "histogram", "Histogram of time to first token in seconds.",
               buckets=TTFT_BUCKETS, alias=n.TTFT),
    VllmMetric(TIME_PER_OUTPUT_TOKEN, "histogram", "Histogram of time per output token in seconds."
               "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", buckets=ITL_BUCKETS),
    VllmMetric(INTER_TOKEN_LATENCY, "histogram", "Histogram of inter-token latency in seconds.", buckets=ITL_BUCKETS),
    VllmMetric(E2E_REQUEST_LATENCY, "histogram", "Histogram of e2e request latency in seconds.",
               buckets=REQUEST_LATENCY_BUCKETS, alias=n.E2E_LATENCY),
    VllmMetric(REQUEST_QUEUE_TIME, "histogram", "Histogram of time spent in WAITING phase for request.",
               buckets=REQUEST_LATENCY_BUCKETS),
    VllmMetric(REQUEST_INFERENCE_TIME, "histogram", "Histogram of time spent in RUNNING phase for request.",
               buckets=REQUEST_LATENCY_BUCKETS),
    VllmMetric(REQUEST_PREFILL_TIME, "histogram", "Histogram of time spent in PREFILL phase for request.",
               buckets=REQUEST_LATENCY_BUCKETS),
    VllmMetric(REQUEST_DECODE_TIME, "histogram", "Histogram of time spent in DECODE phase for request.",
               buckets=REQUEST_LATENCY_BUCKETS),
    VllmMetric(SPEC_DECODE_NUM_DRAFTS, "counter", "Number of spec decoding drafts.", alias=n.SPEC_DRAFTS),
    VllmMetric(SPEC_DECODE_NUM_DRAFT_TOKENS, "counter", "Number of draft tokens.", alias=n.SPEC_DRAFT_TOKENS),
    VllmMetric(SPEC_DECODE_NUM_ACCEPTED_TOKENS, "counter", "Number of accepted tokens.",
               alias=n.SPEC_ACCEPTED_TOKENS),
    # One sample per draft position (label `position`), as vLLM's.
    VllmMetric(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, "counter", "Accepted tokens per draft position.",
               (*ENGINE_LABELS, "position"), alias=n.SPEC_ACCEPTED_PER_POS),
    VllmMetric(CACHE_CONFIG_INFO, "gauge", "Information of the LLMEngine CacheConfig",
               ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "gpu_memory_utilization",
                "model_name", "num_gpu_blocks", "num_scheduler_steps")),
    # vLLM exports it only with --enable-lora; here always (no adapters, max_lora 0), so an endpoint
    # picker that looks for it finds it. The value is the time of the latest update, as vLLM's.
    VllmMetric(LORA_REQUESTS_INFO, "gauge", "Running stats on lora requests.",
               ("max_lora", "waiting_lora_adapters", "running_lora_adapters")),
)

BY_NAME = {metric.name: metric for metric in METRICS}
# Observed here (not shared with a lockstep_ series): the ServerMetrics histograms under these names.
OBSERVED_HISTOGRAMS = tuple(m.name for m in METRICS if m.kind == "histogram" and m.alias is None)


def buckets_of(metric: VllmMetric, max_model_len: int) -> tuple[float, ...]:
    return n.token_buckets(max_model_len) if metric.buckets == TOKENS else metric.buckets
