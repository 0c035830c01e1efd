"""The repository's layering and naming rules (docs/ARCHITECTURE.md)."""

import os
import re
import subprocess
import sys

import pytest

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


PRODUCT_PACKAGES = ("engine", "gateway", "operator", "lockstep", "lockstep_common")


def test_no_product_module_exceeds_500_lines():
    too_long = {}
    for package in PRODUCT_PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as handle:
                        count = sum(1 for _ in handle)
                    if count > 500:
                        too_long[os.path.relpath(path, ROOT)] = count
    assert not too_long, f"product modules over 500 lines (split them): {too_long}"


# A tracker's numbers mean nothing to a reader of the tree: "issue N", "issues #N", "#N issue", "PR #N",
# "pull request N", "(#N)", "GH-N" with N a number. The tree states the fact itself.
TRACKER_REFERENCE = re.compile(
    r"(?<![a-z])issues? ?#?[0-9]+|#[0-9]+ issue|\bPR ?#[0-9]+|\bpull request #?[0-9]+|\(#[0-9]+\)|\bGH-[0-9]+", re.IGNORECASE
)


def test_no_file_refers_to_documents_outside_the_repository_or_to_tracker_issues():
    outside = ("DESIGN" + ".md", "../" + "shared")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = os.path.join(ROOT, name.decode())
        found += [f"file name {name.decode()}: {m}" for m in TRACKER_REFERENCE.findall(name.decode())]
        if not os.path.isfile(path) or name.endswith((b".png", b".gguf")):
            continue
        with open(path, "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
        found += [f"{name.decode()}: {word}" for word in outside if word in text]
        found += [f"{name.decode()}: {m!r}" for m in TRACKER_REFERENCE.findall(text)]
    assert not found, found


# Spelled with N for the number, so that this file passes the test above.
@pytest.mark.parametrize(
    "text", ["see issue N", "Issue #N's fix", "issues N and 5", "the #N issue", "PR #N", "(#N)", "gh-N", "h200_issueN.sh"]
)
def test_the_tracker_pattern_catches_the_usual_spellings(text):
    assert TRACKER_REFERENCE.search(text.replace("N", "23"))


@pytest.mark.parametrize("text", ["# 30 tokens", "an issue with 3 causes", "p99", "color #fff", "tissue 3"])
def test_the_tracker_pattern_leaves_ordinary_text_alone(text):
    assert not TRACKER_REFERENCE.search(text)


def test_gateway_reports_the_version_of_the_lockstep_package():
    code = "import lockstep, lockstep_gateway; assert lockstep_gateway.__version__ == lockstep.__version__"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_shared_package_imports_only_the_standard_library():
    """lockstep_common serves the gateway, the engine and the bare `lockstep` command: importing all of it in a fresh
    interpreter loads no module outside the standard library and itself (`__mp_main__` is no module of its own:
    importing multiprocessing names `__main__` so as well)."""
    code = ("import pkgutil, sys, importlib, lockstep_common; "
            "[importlib.import_module(m.name) for m in pkgutil.iter_modules(lockstep_common.__path__, 'lockstep_common.')]; "
            "print(sorted({n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names) "
            "- {'lockstep_common', '__main__', '__mp_main__'}))")
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
