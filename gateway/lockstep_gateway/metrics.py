"""The gateway's Prometheus metrics, all in one registry per process (prefix `lockstep_gateway_`).

With `--workers N` every worker writes its values to files in `$PROMETHEUS_MULTIPROC_DIR` (set by the
supervisor, lockstep_gateway/workers.py) and `/metrics` of any worker reports them summed over the
workers: counters and histograms summed, in-flight and queue gauges summed over live workers, an
engine's health the highest of the workers' views.

Labels are bounded: routes are fixed, models are the served names (anything else is `unknown`),
engines are the discovered engines, each by an id (`engine_id`: a hash of its URL), because
`/metrics` needs no key and the engines' addresses are the cluster's business; `/gateway/engines`,
behind the key, lists each engine's URL with its id. Nothing request-level (no keys, no users, no
request ids).
"""

from __future__ import annotations

import hashlib
import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from lockstep_common import metrics_names as n

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def engine_id(url: str) -> str:
    """The `engine` label of an engine's series: stable for its URL, and not the URL."""
    return "engine-" + hashlib.sha256(url.encode()).hexdigest()[:12]


class _ByEngine:
    """A family whose first label is `engine`: callers pass the engine's URL, the series carry its id."""

    def labels(self, *values, **named):
        if values:
            values = (engine_id(values[0]), *values[1:])
        elif "engine" in named:
            named = {**named, "engine": engine_id(named["engine"])}
        return super().labels(*values, **named)

    def remove(self, *values):
        return super().remove(engine_id(values[0]), *values[1:])


class _EngineCounter(_ByEngine, Counter):
    pass


class _EngineGauge(_ByEngine, Gauge):
    pass
MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))  # --workers N
# vLLM's time-to-first-token boundaries, the engine's too, so gateway and engine histograms line up on one dashboard.
LATENCY_BUCKETS = n.TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(n.GATEWAY_REQUESTS, "Client requests answered, by route, model and status",
                                ["route", "model", "status"], registry=r)
        self.upstream_latency = Histogram(
            n.GATEWAY_UPSTREAM_LATENCY,
            "Upstream time per attempt: to the first byte of the body (phase=first_byte) and to its end (phase=total)",
            ["route", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_requests = _EngineCounter(n.GATEWAY_UPSTREAM_REQUESTS,
                                         "Attempts sent to an engine, by outcome (ok, error, timeout, retried)",
                                         ["engine", "outcome"], registry=r)
        self.retries = Counter(n.GATEWAY_RETRIES,
                               "Requests retried on another engine after one refused them unstarted", ["reason"],
                               registry=r)
        self.retries_refused = Counter(n.GATEWAY_RETRIES_REFUSED,
                                       "Retries not made because the retry budget was spent", registry=r)
        self.breaker_opened = _EngineCounter(n.GATEWAY_BREAKER_OPENED,
                                      "Times an engine's circuit breaker opened", ["engine"], registry=r)
        self.admission_refused = Counter(n.GATEWAY_ADMISSION_REFUSED,
                                         "Requests refused with 503 because --max-in-flight were in progress",
                                         registry=r)
        self.stream_errors = Counter(n.GATEWAY_STREAM_ERRORS,
                                     "Streams ended with an SSE error event after the first byte", ["reason"], registry=r)
        self.upstream_healthy = _EngineGauge(n.GATEWAY_UPSTREAM_HEALTHY,
                                      "1 while an engine passes health checks and takes requests", ["engine"], registry=r,
                                      multiprocess_mode="livemax")
        self.upstream_in_flight = _EngineGauge(n.GATEWAY_UPSTREAM_IN_FLIGHT,
                                        "Requests the gateway has open on an engine", ["engine"], registry=r,
                                        multiprocess_mode="livesum")
        self.ejections = _EngineCounter(n.GATEWAY_EJECTIONS, "Engines taken out of rotation", ["engine"], registry=r)
        self.queue_depth = Gauge(n.GATEWAY_QUEUE_DEPTH,
                                 "Requests waiting in the gateway for an engine of the model to have room", ["model"],
                                 registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram(n.GATEWAY_QUEUE_WAIT,
                                    "Time a request waited in the gateway's queue before an engine took it", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.requests_refused = Counter(
            n.GATEWAY_REQUESTS_REFUSED,
            "Requests the gateway refused for want of an engine, by reason (429: queue_full past --max-queue-length, "
            "queue_memory past --max-queue-bytes, queue_wait when the engines would not reach it within "
            "--queue-timeout at their drain rate, queue_timeout when the queue stopped moving; 503: sheddable, "
            "unavailable)", ["reason"], registry=r)
        self.queue_drain_rate = Gauge(
            n.GATEWAY_QUEUE_DRAIN_RATE,
            "Requests per second leaving the model's queue while it has a backlog (the engines' measured "
            "throughput, which admission divides the queue by); 0 until measured", ["model"], registry=r,
            multiprocess_mode="livesum")
        self.rate_limited = Counter(n.GATEWAY_RATE_LIMITED,
                                    "Requests refused with 429, by the limit they hit (requests or tokens)", ["limit"],
                                    registry=r)

    def forget_engine(self, url: str) -> None:
        for family in (self.upstream_healthy, self.upstream_in_flight):
            try:
                if MULTIPROCESS:  # its file keeps the last value: 0, not a stale 1
                    family.labels(url).set(0)
                family.remove(url)
            except KeyError:
                pass

    def render(self) -> bytes:
        if MULTIPROCESS:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
