"""The engine server's Prometheus registry: one module, so every metric is declared in one place.

`lockstep_engine.metrics.ServerMetrics` renders the engine's series (step timing from the core's
snapshots, request latencies and token counts observed here, scheduler gauges, and vLLM's routing
names with vLLM's `model_name` label); this module holds it, a registry for the API server's own
histograms, and the few hooks the API server calls. Everything is rendered from state at scrape time.
With several API servers (`--api-server-count`), `api_state` is what each shares and `render` adds the
others' to its own (api/peers.py).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, Metric, generate_latest

from lockstep_engine.metrics import ServerMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REGISTRY = CollectorRegistry(auto_describe=True)
ENGINE = ServerMetrics()

# 1-2-5 buckets from 10 us to 1 s: IPC and per-token host work on the API side.
_FAST_BUCKETS = tuple(m * 10.0 ** e for e in range(-5, 0) for m in (1, 2, 5)) + (1.0,)

STREAM_DELAY = Histogram(
    "lockstep_api_stream_delay_seconds",
    "Engine core emitting a step's tokens -> the API server handing the streamed chunk to the HTTP transport",
    buckets=_FAST_BUCKETS, registry=REGISTRY)


def observe_output_ipc(seconds: float) -> None:
    ENGINE.observe_host_phase("output_ipc", seconds)


def observe_detokenize(seconds: float) -> None:
    ENGINE.observe_host_phase("detokenize", seconds)


def request_started(request_id: str, arrival: float, prompt_len: int, params=None) -> None:
    """`params`: the request's `SamplingParams` (n and max_tokens feed vLLM's request_params series)."""
    ENGINE.request_started(request_id, arrival, prompt_len, getattr(params, "n", 1), getattr(params, "max_tokens", None))


def tokens_received(request_id: str, index: int, num_tokens: int, scheduled_at: float | None = None) -> None:
    ENGINE.tokens_received(request_id, index, num_tokens, time.monotonic(), scheduled_at)


def request_finished(request_id: str, state, default_reason: str) -> None:
    """`state`: the request's `RequestState`, or None when it never reached the output processor."""
    reasons = [seq.finish_reason or default_reason for seq in state.sequences] if state is not None else []
    ENGINE.request_finished(request_id, reasons, time.monotonic())


def observe_stream_delay(seconds: float) -> None:
    STREAM_DELAY.observe(max(seconds, 0.0))


def register_engine(client, model_name: str) -> ServerMetrics:
    """Names the model and points the gauges at the client's latest stats, once the core is ready."""
    ENGINE.attach(model_name, client.ready, client.config.enable_prefix_caching, lambda: client.stats,
                  lambda: client.core_metrics, client.config.gpu_memory_utilization)
    ENGINE.max_loras = client.config.max_loras if client.config.enable_lora else 0
    return ENGINE


def unregister(collector: ServerMetrics) -> None:
    collector.detach()


def api_state() -> tuple:
    """This API server's own series (picklable): the engine collector's and this registry's samples."""
    samples = [(metric.name, metric.documentation, metric.type,
                [(sample.name, sample.labels, sample.value) for sample in metric.samples])
               for metric in REGISTRY.collect()]
    return ENGINE.api_state(), samples


def render(peers: list[tuple] = ()) -> bytes:
    """/metrics; `peers`: the other API servers' `api_state`, summed into this one's."""
    engine = ENGINE.render([state for state, _ in peers]).encode()
    if not peers:
        return engine + generate_latest(REGISTRY)
    return engine + generate_latest(_Summed([api_state()[1], *(samples for _, samples in peers)]))


class _Summed:
    """A registry of this registry's families with every sample summed over API servers (a `_created`
    timestamp is the earliest, not a sum)."""

    def __init__(self, servers: list[list]):
        self.servers = servers

    def collect(self):
        for name, documentation, kind, _ in self.servers[0]:
            metric = Metric(name, documentation, kind)
            values: dict[tuple, float] = {}
            for families in self.servers:
                for sample_name, labels, value in next((f[3] for f in families if f[0] == name), []):
                    key = (sample_name, tuple(sorted(labels.items())))
                    earlier = values.get(key)
                    if earlier is None:
                        values[key] = value
                    else:
                        values[key] = min(earlier, value) if sample_name.endswith("_created") else earlier + value
            for (sample_name, labels), value in values.items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric
