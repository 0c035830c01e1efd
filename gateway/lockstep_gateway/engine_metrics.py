"""Read an engine's load from its Prometheus text: the vLLM gauge names every router understands."""

from __future__ import annotations

from lockstep_common import vllm_metrics as v
from lockstep_common.metrics_names import iter_samples
from lockstep_gateway.routing.candidate import EngineLoad

_GAUGES = {
    v.NUM_REQUESTS_RUNNING: "num_running",
    v.NUM_REQUESTS_WAITING: "num_waiting",
    v.KV_CACHE_USAGE: "kv_cache_usage",
}


def parse_engine_load(text: str) -> EngineLoad | None:
    """Sum each gauge over its label sets (one per served model); None when the engine exports none."""
    values: dict[str, float] = {}
    for name, _, value in iter_samples(text, _GAUGES):
        field = _GAUGES[name]
        values[field] = values.get(field, 0.0) + value
    if not values:
        return None
    return EngineLoad(**values)
