"""The gateway's readiness answer (/ready): ready once it can serve some model, not before."""

from __future__ import annotations

import json
from types import SimpleNamespace

from lockstep_gateway.health import ready_response


def registry(healthy: int = 0, declared: dict[str, set[str]] | None = None) -> SimpleNamespace:
    backends = [SimpleNamespace(healthy=True, models=("smollm2",)) for _ in range(healthy)]
    return SimpleNamespace(healthy=lambda model=None: backends, declared_models=declared or {})


def answer(reg: SimpleNamespace) -> tuple[int, dict]:
    response = ready_response(reg)  # type: ignore[arg-type]
    return response.status_code, json.loads(response.body)


def test_not_ready_before_any_engine_or_model_is_known() -> None:
    assert answer(registry()) == (503, {"status": "no engine", "healthy_engines": 0, "declared_models": []})


def test_ready_with_a_healthy_engine() -> None:
    assert answer(registry(healthy=1))[0] == 200


def test_ready_for_a_declared_model_at_zero_groups_so_its_requests_can_queue() -> None:
    status, body = answer(registry(declared={"endpointslices/lockstep": {"auto"}}))
    assert (status, body["declared_models"]) == (200, ["auto"])
