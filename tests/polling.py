"""Polling with a deadline, for tests that wait on something another process does (no bare sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1) -> T:
    """Call `predicate` every `interval_s` until it returns something truthy, and return that; fail
    naming `what` once `timeout_s` seconds have passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)
