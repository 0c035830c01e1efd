"""Every program reports the installed distribution's version (lockstep_common/version.py), none by importing another."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_engine_the_gateway_and_the_command_report_the_distribution_version():
    code = ("import sys, lockstep_engine, lockstep_gateway; print(lockstep_engine.__version__, "
            "lockstep_gateway.__version__, 'lockstep' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    version = importlib.metadata.version("lockstep")
    assert result.stdout.split() == [version, version, "False"]  # and neither loaded the lockstep package
    import lockstep

    assert lockstep.__version__ == version


def test_a_source_tree_never_installed_says_so(tmp_path):
    """A copy of the shared package alone, without site-packages (python -S): no distribution metadata is found."""
    shutil.copytree(os.path.join(ROOT, "lockstep_common"), tmp_path / "lockstep_common")
    code = "from lockstep_common.version import distribution_version; print(distribution_version())"
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.0.0+unknown"
