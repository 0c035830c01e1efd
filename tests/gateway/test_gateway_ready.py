"""The gateway's readiness answer (/ready): ready once it can serve, not before."""

from __future__ import annotations

import json
from types import SimpleNamespace

from lockstep_gateway.health import ready_response


def registry(engines: int = 0, healthy: int = 0, declared: dict[str, set[str]] | None = None) -> SimpleNamespace:
    backends = {f"http://10.0.0.{n}:8000": SimpleNamespace(healthy=n < healthy) for n in range(engines)}
    return SimpleNamespace(backends=backends, declared_models=declared or {},
                           healthy=lambda model=None: [b for b in backends.values() if b.healthy])  # fmt: skip


def answer(reg: SimpleNamespace) -> tuple[int, str]:
    response = ready_response(reg)  # type: ignore[arg-type]
    return response.status_code, json.loads(response.body)["status"]


def test_not_ready_before_discovery_listed_anything():
    assert answer(registry()) == (503, "discovery has not listed engines yet")


def test_not_ready_while_known_engines_are_all_unhealthy():
    assert answer(registry(engines=2, declared={"kubernetes:lockstep": {"smollm2"}})) == (503, "no healthy engine")


def test_ready_with_a_healthy_engine():
    assert answer(registry(engines=2, healthy=1)) == (200, "ready")


def test_ready_when_discovery_found_no_engine_so_requests_for_a_service_at_zero_can_queue():
    assert answer(registry(declared={"kubernetes:lockstep": {"auto"}})) == (200, "ready")
    assert answer(registry(declared={"kubernetes:lockstep": set()})) == (200, "ready")  # no LLMService yet
