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
_READ = (*_GAUGES, v.LORA_REQUESTS_INFO)


def parse_engine_load(text: str) -> EngineLoad | None:
    """Sum each gauge over its label sets (one per served model), with the adapter slots of the latest
    `vllm:lora_requests_info`; None when the engine exports none of them."""
    values: dict[str, object] = {}
    lora_time, lora_labels = float("-inf"), None
    for name, labels, value in iter_samples(text, _READ):
        if name == v.LORA_REQUESTS_INFO:
            # vLLM keeps every label set it ever exported; the value is when each was last set.
            if value >= lora_time:
                lora_time, lora_labels = value, labels
            continue
        field = _GAUGES[name]
        values[field] = values.get(field, 0.0) + value
    if lora_labels is not None:
        values.update(adapter_slots(lora_labels))
    if not values:
        return None
    return EngineLoad(**values)


def adapter_slots(labels: dict[str, str]) -> dict[str, object]:
    """`max_loras`, `running_adapters`, `waiting_adapters` of one `vllm:lora_requests_info` sample."""
    max_lora = labels.get("max_lora", "0")
    return {"max_loras": int(max_lora) if max_lora.isdigit() else 0,
            "running_adapters": _names(labels.get("running_lora_adapters", "")),
            "waiting_adapters": _names(labels.get("waiting_lora_adapters", ""))}


def _names(joined: str) -> tuple[str, ...]:
    return tuple(sorted(name for name in joined.split(",") if name))
