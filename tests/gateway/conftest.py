"""Fixtures for the gateway tests: two real engines shared by the session and gateways started per test.

The processes themselves, `wait_for` and `FakeEngine` live in gateway_harness.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_harness import Engine, Gateway, wait_for


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="session")
def engines(log_dir: Path) -> Iterator[list[Engine]]:
    """Two real engines for the whole session (tests that kill one start it again)."""
    pair = [Engine("engine-a", log_dir), Engine("engine-b", log_dir)]
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

    def start(*args: str, expect_healthy: set[str] | None = None, env_headers: dict | None = None) -> Gateway:
        gateway = Gateway(f"gateway-{len(started)}-{time.monotonic_ns()}", log_dir, list(args))
        gateway.headers = env_headers or {}
        gateway.start()
        started.append(gateway)
        wait_for("gateway /health", gateway.answers, timeout=30)
        if expect_healthy is not None:
            gateway.wait_engines(expect_healthy)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()
