"""The operator's Prometheus metrics (`lockstep_operator_` prefix, base units: docs/METRICS.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from lockstep_common import metrics_names as n

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    n.OPERATOR_RECONCILES,
    "LLMService reconciles run, failed ones included.",
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    n.OPERATOR_RECONCILE_ERRORS,
    "LLMService reconciles that raised an error (retried with backoff).",
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    n.OPERATOR_RECONCILE_DURATION,
    "Wall time of one LLMService reconcile, API calls included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
GROUP_RESTARTS = Counter(
    n.OPERATOR_GROUP_RESTARTS,
    "Engine groups restarted as a whole because a member pod restarted, failed or was lost.",
    registry=REGISTRY,
)
GROUP_UPDATES = Counter(
    n.OPERATOR_GROUP_UPDATES,
    "Engine groups replaced by a rolling update to a new revision.",
    registry=REGISTRY,
)
