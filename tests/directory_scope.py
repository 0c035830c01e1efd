"""Session fixtures whose processes one test directory alone uses are stopped when the run leaves that
directory, not at the end of the session: the SmolLM2 servers of tests/api would otherwise hold several
GiB for the whole rest of the run, which a small CI machine pays for in swap or in the OOM killer.

A conftest registers a cleanup with `at_directory_end(__file__, cleanup)`; the root conftest runs this
module's `pytest_runtest_teardown`, which calls the cleanups of a directory after its last test (the
next test lies elsewhere, or none is left). A fixture that is used again afterwards must be able to start
over (the cleanup leaves it empty, not broken)."""

from __future__ import annotations

import os
from collections.abc import Callable

_CLEANUPS: dict[str, list[Callable[[], None]]] = {}


def at_directory_end(conftest_file: str, cleanup: Callable[[], None]) -> None:
    directory = os.path.dirname(os.path.abspath(conftest_file))
    _CLEANUPS.setdefault(directory, []).append(cleanup)


def pytest_runtest_teardown(item, nextitem) -> None:
    here = str(item.path.parent)
    if nextitem is not None and str(nextitem.path.parent).startswith(here):
        return
    for cleanup in _CLEANUPS.pop(here, []):
        cleanup()
