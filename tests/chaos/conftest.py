"""Fixtures for the chaos suite: two real `random:tiny` engines of its own (the suite kills, freezes
and poisons them) and gateways started per test. The processes come from tests/gateway's harness."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gateway_harness import Engine, Gateway, wait_for


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos-logs")


@pytest.fixture(scope="module")
def engines(log_dir: Path) -> Iterator[list[Engine]]:
    pair = [Engine("chaos-a", log_dir), Engine("chaos-b", log_dir)]
    try:
        for engine in pair:
            engine.start()
        for engine in pair:
            engine.wait_healthy()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@pytest.fixture
def start_gateway(log_dir: Path) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(*args: str, expect_healthy: set[str] | None = None) -> Gateway:
        gateway = Gateway(f"gateway-{len(started)}-{time.monotonic_ns()}", log_dir, list(args))
        gateway.start()
        started.append(gateway)
        wait_for("gateway /health", gateway.answers, timeout=30)
        if expect_healthy is not None:
            gateway.wait_engines(expect_healthy)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()
