"""`lockstep_common.metrics_names` is the one place names and buckets are fixed: it matches what each process exports."""

from __future__ import annotations

from prometheus_client import generate_latest

from lockstep_common import metrics_names as n
from lockstep_common import vllm_metrics as v


def _declared(text: str) -> set[str]:
    """The families a /metrics text declares (prometheus_client's `_created` companions left out)."""
    return {name for line in text.splitlines() if line.startswith("# TYPE ")
            if not (name := line.split(" ")[2]).endswith("_created")}


def test_gap_buckets_are_the_1_2_5_series_from_2us_to_100ms():
    assert n.GAP_BUCKETS == (2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1)
    assert n.token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert n.TTFT_BUCKETS[0] == 0.001 and n.TTFT_BUCKETS[-1] == 2560.0  # vLLM's boundaries


def test_engine_exports_every_engine_name():
    from lockstep_engine.metrics import ServerMetrics

    declared = _declared(ServerMetrics().render())
    engine_names = {value for key, value in vars(n).items() if isinstance(value, str) and key.isupper()
                    and value.startswith("lockstep_")
                    and not value.startswith(("lockstep_gateway_", "lockstep_operator_"))}
    engine_names |= {metric.name for metric in v.METRICS if metric.kind != "counter"}
    # The info series appear once the core is ready (they carry its configuration).
    assert engine_names - declared == {v.CACHE_CONFIG_INFO, v.LORA_REQUESTS_INFO, n.STEP_TIMER_INFO}
    assert all(":" not in name for name in declared if not name.startswith("vllm:"))
    assert all(name.endswith("_total") for name in declared if name in (n.STEPS, n.GPU_IDLE, n.WASTED_TOKENS))


def test_gateway_and_operator_export_the_shared_names():
    from lockstep_gateway.metrics import GatewayMetrics
    from lockstep_operator.metrics import REGISTRY

    gateway = _declared(GatewayMetrics().render().decode())
    assert gateway == _shared("GATEWAY_")
    operator = _declared(generate_latest(REGISTRY).decode())
    assert {name for name in operator if name.startswith("lockstep_")} == _shared("OPERATOR_")


def _shared(prefix: str) -> set[str]:
    return {value for key, value in vars(n).items() if key.startswith(prefix)}


def test_parse_samples_reads_labels_and_drops_timestamps():
    text = ('# HELP x_total X\n# TYPE x_total counter\nx_total{a="1",b="two words"} 3.0\n'
            'vllm:num_requests_waiting{model_name="m"} 2.0 1700000000000\nplain 4\n')
    assert n.parse_samples(text) == {("x_total", (("a", "1"), ("b", "two words"))): 3.0,
                                     ("vllm:num_requests_waiting", (("model_name", "m"),)): 2.0,
                                     ("plain", ()): 4.0}
