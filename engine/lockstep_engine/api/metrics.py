"""The engine server's Prometheus registry: one module, so every metric is declared in one place.

Scheduler gauges are read from the engine core's latest stats at scrape time (no polling loop).
The vLLM names (`vllm:num_requests_running`, ...) are exported next to Lockstep's own so routers and
autoscalers built for vLLM read this server unchanged; they keep vLLM's `model_name` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REGISTRY = CollectorRegistry(auto_describe=True)

# 1-2-5 buckets from 10 us to 1 s: IPC and per-token host work on the API side.
_FAST_BUCKETS = tuple(m * 10.0 ** e for e in range(-5, 0) for m in (1, 2, 5)) + (1.0,)

HOST_PHASE = Histogram(
    "lockstep_host_phase_seconds", "Host time of one phase of the serving loop, per engine step",
    ["phase"], buckets=_FAST_BUCKETS, registry=REGISTRY)
STREAM_DELAY = Histogram(
    "lockstep_api_stream_delay_seconds",
    "Engine core emitting a step's tokens -> the API server handing the streamed chunk to the HTTP transport",
    buckets=_FAST_BUCKETS, registry=REGISTRY)

FINISHED = Counter(
    "lockstep_requests_finished", "Samples (choices) that ended, by how: stop, length, abort (client gone or "
    "shutdown) or error (engine core lost)", ["reason"], registry=REGISTRY)

_OUTPUT_IPC = HOST_PHASE.labels(phase="output_ipc")
_DETOKENIZE = HOST_PHASE.labels(phase="detokenize")


def observe_output_ipc(seconds: float) -> None:
    _OUTPUT_IPC.observe(max(seconds, 0.0))


def observe_detokenize(seconds: float) -> None:
    _DETOKENIZE.observe(seconds)


def count_finished(reason: str) -> None:
    FINISHED.labels(reason=reason).inc()


def observe_stream_delay(seconds: float) -> None:
    STREAM_DELAY.observe(max(seconds, 0.0))


class EngineCollector:
    """Gauges and counters from the engine core's stats, as of the last message it sent."""

    def __init__(self, client, model_name: str):
        self.client = client
        self.model_name = model_name

    def collect(self):
        stats = self.client.stats
        labels = {"model_name": self.model_name}
        for name, help_text, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, help_text, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family
        steps = CounterMetricFamily("lockstep_steps", "Decode/prefill steps the engine core ran")
        steps.add_metric([], stats.num_steps)
        yield steps
        busy = CounterMetricFamily("lockstep_gpu_busy_seconds", "Seconds the device spent in forward + sample")
        busy.add_metric([], stats.busy_s)
        yield busy


def register_engine(client, model_name: str) -> EngineCollector:
    collector = EngineCollector(client, model_name)
    REGISTRY.register(collector)
    return collector


def unregister(collector: EngineCollector) -> None:
    REGISTRY.unregister(collector)


def render() -> bytes:
    return generate_latest(REGISTRY)
