"""Fixtures for the gateway tests: two real engines shared by the session and gateways started per test.

The processes themselves, `wait_for` and `FakeEngine` live in gateway_harness.py (shared with tests/chaos).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_harness import Engine, Gateway, gateway_starter, running_engines


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="session")
def engines(log_dir: Path) -> Iterator[list[Engine]]:
    """Two real engines for the whole session (tests that kill one start it again)."""
    with running_engines(["engine-a", "engine-b"], log_dir) as pair:
        yield pair


@pytest.fixture
def start_gateway(log_dir: Path) -> Iterator[Callable[..., Gateway]]:
    with gateway_starter(log_dir) as start:
        yield start
