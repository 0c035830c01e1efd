"""Fixtures for the chaos suite: two real `random:tiny` engines of its own (the suite kills, freezes
and poisons them) and gateways started per test. The processes and the fixtures' bodies come from
tests/gateway's harness."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gateway_harness import Engine, Gateway, gateway_starter, running_engines


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos-logs")


@pytest.fixture(scope="module")
def engines(log_dir: Path) -> Iterator[list[Engine]]:
    with running_engines(["chaos-a", "chaos-b"], log_dir) as pair:
        yield pair


@pytest.fixture
def start_gateway(log_dir: Path) -> Iterator[Callable[..., Gateway]]:
    with gateway_starter(log_dir) as start:
        yield start
