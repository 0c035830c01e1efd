"""Stopping a child process the tests started, shared by test folders that cannot import each other's
harness (tests/ is on sys.path through tests/conftest.py; each folder's own directory only while it runs)."""

from __future__ import annotations

import subprocess


def stop_child(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace_s` seconds; reaped either way."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
