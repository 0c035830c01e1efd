"""The repository's layering and naming rules (docs/ARCHITECTURE.md)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_layering_contracts_hold():
    result = subprocess.run(["lint-imports"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "KEPT" in result.stdout


def test_operator_folder_never_shadows_the_standard_library():
    result = subprocess.run([sys.executable, "-S", "-c", "import operator; print(operator.__file__)"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not result.stdout.strip().startswith(ROOT), result.stdout
    assert not os.path.exists(os.path.join(ROOT, "operator", "__init__.py"))


def test_scheduling_core_imports_without_torch():
    code = ("import sys; import lockstep_engine.scheduler, lockstep_engine.block_manager, "
            "lockstep_engine.sampling_params, lockstep_engine.config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_no_engine_module_exceeds_500_lines():
    engine = os.path.join(ROOT, "engine", "lockstep_engine")
    too_long = {}
    for folder, _, files in os.walk(engine):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    count = sum(1 for _ in handle)
                if count > 500:
                    too_long[os.path.relpath(path, ROOT)] = count
    assert not too_long, f"engine modules over 500 lines (split them): {too_long}"
