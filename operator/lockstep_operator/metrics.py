"""The operator's Prometheus metrics (`lockstep_operator_` prefix, base units: docs/METRICS.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "lockstep_operator_reconciles_total",
    "LLMService reconciles run, failed ones included.",
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "lockstep_operator_reconcile_errors_total",
    "LLMService reconciles that raised an error (retried with backoff).",
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "lockstep_operator_reconcile_duration_seconds",
    "Wall time of one LLMService reconcile, API calls included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
GROUP_RESTARTS = Counter(
    "lockstep_operator_group_restarts_total",
    "Engine groups restarted as a whole because a member pod restarted, failed or was lost.",
    registry=REGISTRY,
)
GROUP_UPDATES = Counter(
    "lockstep_operator_group_updates_total",
    "Engine groups replaced by a rolling update to a new revision.",
    registry=REGISTRY,
)
