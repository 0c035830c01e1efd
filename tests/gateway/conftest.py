"""Fixtures for the gateway tests: two real engines shared by the session and gateways started per test.

The processes themselves, `wait_for` and `FakeEngine` live in gateway_harness.py (shared with tests/chaos).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import warnings

import pytest
from gateway_harness import Engine, Gateway, gateway_starter, running_engines


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="session")
def session_engines(log_dir: Path) -> Iterator[list[Engine]]:
    """Two real engines for the whole session (tests that kill one start it again)."""
    with running_engines(["engine-a", "engine-b"], log_dir) as pair:
        yield pair


@pytest.fixture
def engines(session_engines: list[Engine]) -> list[Engine]:
    """The session's engines, each checked alive before the test. One found dead outside any test that kills
    engines is started again on its port, with a warning that carries its exit status and its last output:
    the tests after it then run against two engines as they expect, and the warnings summary says why."""
    for engine in session_engines:
        if engine.alive():
            continue
        code = engine.process.poll() if engine.process is not None else None
        warnings.warn(f"engine {engine.name} ({engine.url}) was found dead before this test (exit status {code}); "
                      f"started again. Its last output:\n{engine.log_tail(40)}", stacklevel=1)
        engine.start()
        engine.wait_healthy()
    return session_engines


@pytest.fixture
def start_gateway(log_dir: Path) -> Iterator[Callable[..., Gateway]]:
    with gateway_starter(log_dir) as start:
        yield start
