"""A child tied to its parent (lockstep_common.sockets.die_with_parent) ends when the parent dies, however it dies."""

from __future__ import annotations

import os
import subprocess
import sys
import time

# The parent starts a child that sleeps, tied to it, prints the child's pid, then dies without cleaning up.
PARENT = """
import os, subprocess, sys
from lockstep_common.sockets import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
os._exit(0)
"""


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended already
    except FileNotFoundError:
        return True


def test_the_child_ends_when_its_parent_dies():
    parent = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    child = int(parent.stdout)
    deadline = time.monotonic() + 10
    while not _is_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _is_gone(child), f"pid {child} outlived its parent"
