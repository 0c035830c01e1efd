"""spec.autoscaling: how many groups the demand needs, from the engines' and the gateway's gauges. Pure.

The signal is the demand the engines and the gateway report, as vLLM-compatible routers and KEDA
recipes read it: `vllm:num_requests_waiting` and `vllm:num_requests_running` summed over the ready
leaders, plus `lockstep_gateway_queue_depth{model}` (requests the gateway holds because no engine of
the model could take them; the only demand there is while the service has no group).

* up: when more requests wait than `targetWaitingPerGroup` per group, enough groups are added at
  once for the excess (`current + ceil((waiting - target x current) / target)`); at zero groups any
  waiting request asks for the first group;
* down: one group at a time, once everything in flight (waiting and running) would have fitted in
  one group fewer at the target for `scaleDownDelaySeconds` without a break; so with
  `minReplicas: 0` an idle service goes to zero a delay after its last request;
* always within `minReplicas..maxReplicas`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from lockstep_common.metrics_names import iter_samples


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    target_waiting_per_group: int
    scale_down_delay_seconds: int


@dataclass(frozen=True)
class Demand:
    waiting: float = 0.0  # summed over the ready leaders
    running: float = 0.0
    queued: float = 0.0  # in the gateways, for this model


def _seconds_between(earlier: str, later: str) -> float:
    def parse(stamp: str) -> datetime:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)

    return (parse(later) - parse(earlier)).total_seconds()


def desired_replicas(
    current: int, demand: Demand, policy: Autoscaling, previous: Mapping[str, Any] | None, now: str,
    settled: bool = True,
) -> tuple[int, dict[str, Any]]:
    """The group count to scale to, and the status.autoscaling that explains it. While groups are
    starting (`settled` false) their demand cannot be read yet, so the scale-down delay does not run."""
    previous = previous or {}
    target = policy.target_waiting_per_group
    waiting = demand.waiting + demand.queued
    in_flight = waiting + demand.running
    desired = current
    quiet_since = None
    if waiting > target * current:
        desired = current + math.ceil((waiting - target * current) / target)
    elif settled and current > 0 and in_flight <= target * (current - 1):
        quiet_since = previous.get("quietSince") or now
        if _seconds_between(quiet_since, now) >= policy.scale_down_delay_seconds:
            desired, quiet_since = current - 1, None
    desired = max(policy.min_replicas, min(policy.max_replicas, desired))
    status: dict[str, Any] = {
        "desiredReplicas": desired,
        "waiting": waiting,
        "running": demand.running,
        "queued": demand.queued,
    }
    if quiet_since is not None and desired == current:
        status["quietSince"] = quiet_since
    last_scale = now if desired != current else previous.get("lastScaleTime")
    if last_scale:
        status["lastScaleTime"] = last_scale
    return desired, status


def gauge_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of one gauge's samples in a Prometheus text exposition, those with `labels` only."""
    wanted = (labels or {}).items()
    return sum(value for _, found, value in iter_samples(text, (name,)) if all(found.get(k) == v for k, v in wanted))
