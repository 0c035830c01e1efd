"""Fixtures for the Kubernetes tests: a real control plane, the chart installed by Helm, the operator.

Session-scoped, started on first use: the pure unit tests in this folder never start anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from child_process import stop_child
from k8s_harness import CHART, RELEASE_VALUES, ControlPlane, binaries, free_port, kubeconfig, kubectl_binary, wait_for

RELEASE = "lockstep"
RELEASE_NAMESPACE = "lockstep-system"
TEST_ENGINE_IMAGE = "registry.invalid/lockstep:0.1.0-test"
PSS_ENFORCE = "pod-security.kubernetes.io/enforce"


class Kubectl:
    """The real kubectl binary against the test cluster."""

    def __init__(self, kubeconfig_path: Path) -> None:
        self.binary = kubectl_binary()
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig_path)}

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.binary, *args], input=stdin, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def get(self, *args: str) -> Any:
        return json.loads(self.run("get", *args, "-o", "json").stdout)

    def apply(
        self, manifest: dict[str, Any] | str, namespace: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.run("apply", "-n", namespace, "-f", "-", stdin=text, check=check)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("kube"), binaries())
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Kubectl:
    return Kubectl(control_plane.kubeconfig)


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane):  # type: ignore[no-untyped-def]
    """A Kubernetes API client with admin rights, for what a kubelet would do (pod status)."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(str(control_plane.kubeconfig))
    yield client.CoreV1Api(api_client)
    api_client.close()


@pytest.fixture(scope="session")
def release(control_plane: ControlPlane, kubectl: Kubectl) -> dict[str, Any]:
    """The chart installed by Helm's Go SDK: the CRD from crds/, RBAC, the operator and gateway Deployments.

    Cluster-wide (each test makes its own namespace), into a namespace that enforces the
    "restricted" Pod Security Standard, so the API server admits the chart's pods only if they pass.
    """
    import helm_python as helm

    kubectl.run("create", "namespace", RELEASE_NAMESPACE)
    kubectl.run("label", "namespace", RELEASE_NAMESPACE, f"{PSS_ENFORCE}=restricted")
    with helm.Config(kubeconfig_path=str(control_plane.kubeconfig), namespace=RELEASE_NAMESPACE) as cfg:
        installed = cfg.install(str(CHART), RELEASE, RELEASE_VALUES, timeout=120)
    kubectl.run(
        "wait", "--for=condition=Established", "crd/llmservices.serving.lockstep.dev", "--timeout=60s"
    )
    return installed


@pytest.fixture(scope="session")
def operator(
    control_plane: ControlPlane,
    kubectl: Kubectl,
    release: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
):  # type: ignore[no-untyped-def]
    """`python -m lockstep_operator` running as the chart's ServiceAccount, so the chart's RBAC is what it gets."""
    workdir = tmp_path_factory.mktemp("operator")
    token = kubectl.run(
        "create", "token", f"{RELEASE}-operator", "-n", RELEASE_NAMESPACE, "--duration=2h"
    ).stdout.strip()
    config_path = workdir / "kubeconfig"
    config_path.write_text(
        json.dumps(kubeconfig(control_plane.server, control_plane.dir / "ca.crt", {"token": token}))
    )
    metrics_port, health_port = free_port(), free_port()
    log_path = workdir / "operator.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lockstep_operator",
            "--engine-image",
            TEST_ENGINE_IMAGE,
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
            "--health-port",
            str(health_port),
            "--resync-seconds",
            "30",
        ],  # fmt: skip
        env={**os.environ, "KUBECONFIG": str(config_path)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"operator exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_for("operator /healthz", healthy, timeout=60)
        yield OperatorProcess(process, metrics_port, log_path)
    finally:
        stop_child(process, grace_s=20)
        log.close()


class OperatorProcess:
    def __init__(self, process: subprocess.Popen[bytes], metrics_port: int, log_path: Path) -> None:
        self.process = process
        self.metrics_port = metrics_port
        self.log_path = log_path

    def metric(self, name: str) -> float:
        """The current value of an unlabelled series on the operator's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} not exported")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", name)
    yield name
    # LLMServices first, so the operator is not left restarting groups whose pods the namespace
    # deletion removes; the rest goes with the namespace.
    kubectl.run("delete", "llmservices", "--all", "-n", name, "--wait=true", "--timeout=30s", check=False)
    kubectl.run("delete", "namespace", name, "--wait=false", check=False)
