"""hack/kube/build.sh and the harness honour KUBEBUILDER_ASSETS and build nothing that is there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from k8s_harness import BUILD_SCRIPT, binaries

NAMES = ("etcd", "kube-apiserver", "kube-controller-manager")


def fake_assets(directory: Path, names: tuple[str, ...]) -> Path:
    directory.mkdir()
    for name in names:
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(0o755)
    return directory


def build(tmp_path: Path, *args: str, assets: Path | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCKSTEP_KUBE_CACHE": str(tmp_path / "cache")}
    env.pop("KUBEBUILDER_ASSETS", None)
    if assets is not None:
        env["KUBEBUILDER_ASSETS"] = str(assets)
    return subprocess.run(
        ["bash", str(BUILD_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_complete_envtest_assets_mean_nothing_is_built(tmp_path):
    assets = fake_assets(tmp_path / "assets", NAMES)
    result = build(tmp_path, assets=assets)
    assert result.returncode == 0, result.stderr
    assert "building" not in result.stderr
    assert result.stdout.strip() == str(tmp_path / "cache" / "v1.37.2")


def test_check_names_what_is_missing_and_builds_nothing(tmp_path):
    assets = fake_assets(
        tmp_path / "assets", ("etcd", "kube-apiserver")
    )  # envtest ships no controller manager
    result = build(tmp_path, "--check", assets=assets)
    assert result.returncode == 1
    assert result.stderr.strip().endswith(": kube-controller-manager; run make k8s-bins")
    assert not (tmp_path / "cache").exists()


def test_the_harness_prefers_kubebuilder_assets(tmp_path, monkeypatch):
    if subprocess.run(["bash", str(BUILD_SCRIPT), "--check"], capture_output=True).returncode != 0:
        pytest.skip("control-plane binaries not built (make k8s-bins)")
    assets = fake_assets(tmp_path / "assets", ("etcd", "kube-apiserver"))
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    found = binaries()
    assert found["etcd"] == assets / "etcd"
    assert found["kube-apiserver"] == assets / "kube-apiserver"
    assert found["kube-controller-manager"].parent != assets
