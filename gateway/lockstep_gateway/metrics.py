"""The gateway's Prometheus metrics, all in one registry per process (prefix `lockstep_gateway_`).

Labels are bounded: routes are fixed, models are the served names (anything else is `unknown`),
engines are the discovered URLs. Nothing request-level (no keys, no users, no request ids).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's request-latency boundaries, so gateway and engine histograms line up on one dashboard.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("lockstep_gateway_requests", "Client requests answered, by route, model and status",
                                ["route", "model", "status"], registry=r)
        self.upstream_latency = Histogram(
            "lockstep_gateway_upstream_latency_seconds",
            "Upstream time per attempt: to the first byte of the body (phase=first_byte) and to its end (phase=total)",
            ["route", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_requests = Counter("lockstep_gateway_upstream_requests",
                                         "Attempts sent to an engine, by outcome (ok, error, timeout, retried)",
                                         ["engine", "outcome"], registry=r)
        self.retries = Counter("lockstep_gateway_retries",
                               "Requests retried on another engine after one refused them unstarted", ["reason"],
                               registry=r)
        self.retries_refused = Counter("lockstep_gateway_retries_refused",
                                       "Retries not made because the retry budget was spent", registry=r)
        self.breaker_opened = Counter("lockstep_gateway_breaker_opened",
                                      "Times an engine's circuit breaker opened", ["engine"], registry=r)
        self.admission_refused = Counter("lockstep_gateway_admission_refused",
                                         "Requests refused with 503 because --max-in-flight were in progress",
                                         registry=r)
        self.stream_errors = Counter("lockstep_gateway_stream_errors",
                                     "Streams ended with an SSE error event after the first byte", ["reason"], registry=r)
        self.upstream_healthy = Gauge("lockstep_gateway_upstream_healthy",
                                      "1 while an engine passes health checks and takes requests", ["engine"], registry=r)
        self.upstream_in_flight = Gauge("lockstep_gateway_upstream_in_flight",
                                        "Requests the gateway has open on an engine", ["engine"], registry=r)
        self.ejections = Counter("lockstep_gateway_ejections", "Engines taken out of rotation", ["engine"], registry=r)
        self.rate_limited = Counter("lockstep_gateway_rate_limited_requests",
                                    "Requests refused with 429, by the limit they hit (requests or tokens)", ["limit"],
                                    registry=r)

    def forget_engine(self, url: str) -> None:
        for family in (self.upstream_healthy, self.upstream_in_flight):
            try:
                family.remove(url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
