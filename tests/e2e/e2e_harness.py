"""Helpers of the end-to-end tests (tests/e2e/conftest.py has the fixtures): polling with a deadline,
scenario lines, kubectl, the LLMService the scenarios apply, and the Prometheus scenario's discovery.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from child_process import stop_child

ROOT = Path(__file__).resolve().parents[2]
CHART = Path(os.environ.get("LOCKSTEP_E2E_CHART", ROOT / "charts" / "lockstep"))
EXAMPLE = CHART / "examples" / "llmservice.yaml"  # the file the docs apply
KUBECONFIG = os.environ.get("LOCKSTEP_E2E_KUBECONFIG", "")
NAMESPACE = "lockstep"
RELEASE = "lockstep"
VERSION = "0.1.0"
ENGINE_TAG = f"{VERSION}-cpu"
# The only pods networkPolicy.gatewayFrom admits to the gateway (besides what the chart admits itself:
# the operator, the helm test pod, monitoring namespaces).
GATEWAY_CLIENT_LABEL = "e2e.lockstep.dev/gateway-client"
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Polls `check` until it returns something truthy; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - the last error is reported on timeout
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f": {last}" if last else ""))
        time.sleep(interval)


def say(message: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", flush=True)


@contextmanager
def scenario(name: str) -> Iterator[None]:
    """Prints one clear line per scenario: PASS or FAIL and its wall time."""
    start = time.monotonic()
    say(f"SCENARIO {name}: start")
    try:
        yield
    except BaseException:
        say(f"SCENARIO {name}: FAIL after {time.monotonic() - start:.0f} s")
        raise
    say(f"SCENARIO {name}: PASS in {time.monotonic() - start:.0f} s")


class Kubectl:
    def __init__(self, binary: str, kubeconfig: str) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig

    def command(self, *args: str) -> list[str]:
        return [self.binary, "--kubeconfig", self.kubeconfig, *args]

    def run(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 120,
        stdin: str | None = None,
    ):
        result = subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.run("apply", "-f", "-", stdin=json.dumps(manifest))

    @contextmanager
    def port_forward(self, target: str, port: int, namespace: str = NAMESPACE) -> Iterator[int]:
        """`kubectl port-forward TARGET :PORT`; yields the local port on 127.0.0.1."""
        process = subprocess.Popen(
            self.command(
                "port-forward",
                "-n",
                namespace,
                "--address",
                "127.0.0.1",
                target,
                f":{port}",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert process.stdout is not None
            deadline = time.monotonic() + 60
            local = None
            while local is None and time.monotonic() < deadline:
                line = process.stdout.readline()
                if not line:
                    break
                match = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
                if match:
                    local = int(match.group(1))
            if local is None:
                raise AssertionError(f"kubectl port-forward {target} did not start: {process.poll()}")
            yield local
        finally:
            stop_child(process, grace_s=10)


RELEASE_VALUES: dict[str, Any] = {
    "engine": {"image": {"tag": ENGINE_TAG}},
    # One gateway replica and small requests: the node has 2 cores for everything.
    "gateway": {
        "replicas": 1,
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
        # A request at zero groups waits while a group starts: about 80 s on this loaded node.
        "extraArgs": ["--queue-timeout=600"],
    },
    "operator": {
        "resyncSeconds": 10,
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
    },
    # Who may call the gateway: the probe pod labelled so; the scale-from-zero and helm test scenarios
    # show the operator and the test pod still reach it.
    "networkPolicy": {"gatewayFrom": [{"podSelector": {"matchLabels": {GATEWAY_CLIENT_LABEL: "true"}}}]},
}


def llmservice(
    name: str,
    *,
    tensor: int = 1,
    pipeline: int = 1,
    replicas: int = 1,
    **parallelism: int,
) -> dict[str, Any]:
    """A SmolLM2 LLMService on the CPU image, sized for a 2-core node."""
    return {
        "apiVersion": "serving.lockstep.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "smollm2", "servedName": name},
            "decode": {"numSchedulerSteps": 8},
            "parallelism": {
                "tensor": tensor,
                "pipeline": pipeline,
                "gpusPerPod": 0,
                **parallelism,
            },
            "replicas": replicas,
            "engine": {
                "maxNumSeqs": 8,
                "maxModelLen": 1024,
                # The default KV cache (2 GiB per rank) would not fit six engine processes on this node.
                "extraArgs": ["--kv-cache-memory-bytes", str(256 * 2**20)],
                # Each rank process holds torch, the fp32 weights and its KV cache; a TP=3 pod under a
                # 3 GiB limit lost a rank to the OOM killer (exit -9): 2 GiB per rank plus 1.
                "resources": {
                    "requests": {"cpu": "100m", "memory": "512Mi"},
                    "limits": {"memory": f"{1 + 2 * parallelism.get('ranksPerPod', 1)}Gi"},
                },
            },
            "startup": {"timeoutSeconds": 600},
        },
    }


def meta_label(name: str) -> str:
    """A Kubernetes label as Prometheus' service discovery names it (`__meta_kubernetes_pod_label_<name>`)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered_pod_targets(kubectl: Kubectl) -> list[dict[str, Any]]:
    """What Prometheus' `kubernetes_sd_configs` (role: pod) discovers in the namespace, as file_sd groups:
    one target per container port of every running pod, with the pod's labels as meta labels. Debian's
    prometheus 2.42 is built without kubernetes_sd, so the test lists the pods and hands them over."""
    groups = []
    for pod in kubectl.json("get", "pods", "-n", NAMESPACE)["items"]:
        ip = pod["status"].get("podIP")
        if pod["status"].get("phase") != "Running" or not ip:
            continue
        labels = {meta_label(k): v for k, v in pod["metadata"].get("labels", {}).items()}
        labels |= {"__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": pod["metadata"]["name"]}
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels | {
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})  # fmt: skip
    return groups


def podmonitor_scrape_config(monitor: dict[str, Any], file_sd: str) -> dict[str, Any]:
    """The PodMonitor as Prometheus Operator translates it: keep pods whose labels match the selector and
    the named port, then the monitor's own relabelings."""
    spec = monitor["spec"]
    relabel: list[dict[str, Any]] = [
        {"source_labels": [meta_label(k)], "regex": v, "action": "keep"} for k, v in spec["selector"]["matchLabels"].items()
    ]
    for expr in spec["selector"].get("matchExpressions", []):
        action = {"In": "keep", "NotIn": "drop"}[expr["operator"]]
        relabel.append({"source_labels": [meta_label(expr["key"])], "regex": "|".join(expr["values"]), "action": action})
    endpoint = spec["podMetricsEndpoints"][0]
    relabel.append({"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"], "action": "keep"})
    relabel.append({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"})
    relabel += [{"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]} for r in endpoint.get("relabelings", [])]
    return {"job_name": "engines", "metrics_path": endpoint.get("path", "/metrics"),
            "file_sd_configs": [{"files": [file_sd]}], "relabel_configs": relabel}  # fmt: skip
