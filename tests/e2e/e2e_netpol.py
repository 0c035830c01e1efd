"""Probe pods of the NetworkPolicy scenario: pods that try to open an engine's port from inside the
cluster, with and without the engine-client label, and report what happened to each connection.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from e2e_harness import GATEWAY_CLIENT_LABEL, NAMESPACE, VERSION, Kubectl

# Any image on the node with python3 serves; the gateway's is the smallest of them.
PROBE_IMAGE = f"ghcr.io/lockstep-dev/lockstep-gateway:{VERSION}"
CLIENT_LABEL = "serving.lockstep.dev/engine-client"
OTHER_NAMESPACE = "lockstep-netpol"
CONNECT_TIMEOUT_S = 5

# Runs in a probe pod: for each HOST:PORT, "connected <HTTP status line>" (or "connected, no reply"),
# "refused" (a REJECT answers at once) or "timeout" (a DROP, after CONNECT_TIMEOUT_S).
PROBE = """
import json, socket, sys, time
timeout, result = float(sys.argv[1]), {}
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    start = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(b"GET /health HTTP/1.0\\r\\nHost: probe\\r\\n\\r\\n")
            try:
                outcome = "connected " + s.recv(64).split(b"\\r\\n")[0].decode(errors="replace")
            except OSError:
                outcome = "connected, no reply"
    except ConnectionRefusedError:
        outcome = "refused"
    except socket.timeout:
        outcome = "timeout"
    except OSError as exc:
        outcome = f"error {exc}"
    result[target] = {"outcome": outcome, "seconds": round(time.monotonic() - start, 2)}
print(json.dumps(result))
"""


def probe_pod(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod that only sleeps (the probes run in it by `kubectl exec`); restricted Pod Security."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "probe",
                    "image": PROBE_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", "import time; time.sleep(3600)"],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "96Mi"}},
                }
            ],
        },
    }


# name -> (namespace, labels): no label; the labels in the release namespace; the labels elsewhere.
# The engine-client label admits to engines, the gateway-client one to the gateway (gatewayFrom).
PROBES: dict[str, tuple[str, dict[str, str]]] = {
    "netpol-stranger": (NAMESPACE, {"app": "netpol-probe"}),
    "netpol-client": (NAMESPACE, {"app": "netpol-probe", CLIENT_LABEL: "true", GATEWAY_CLIENT_LABEL: "true"}),
    "netpol-elsewhere": (OTHER_NAMESPACE, {"app": "netpol-probe", CLIENT_LABEL: "true", GATEWAY_CLIENT_LABEL: "true"}),
}


@contextmanager
def probe_pods(kubectl: Kubectl) -> Iterator[None]:
    """Creates the probe pods (and their other namespace), waits for them to run, deletes them after."""
    kubectl.run("create", "namespace", OTHER_NAMESPACE)
    try:
        for name, (namespace, labels) in PROBES.items():
            kubectl.apply(probe_pod(name, namespace, labels))
        for name, (namespace, _) in PROBES.items():
            kubectl.run("wait", "-n", namespace, f"pod/{name}", "--for=condition=Ready", "--timeout=180s", timeout=200)
        yield
    finally:
        for name, (namespace, _) in PROBES.items():
            kubectl.run("delete", "pod", name, "-n", namespace, "--ignore-not-found", "--wait=true", timeout=120)
        kubectl.run("delete", "namespace", OTHER_NAMESPACE, "--wait=true", "--timeout=120s", timeout=150)


def probe(kubectl: Kubectl, name: str, targets: list[str]) -> dict[str, dict[str, Any]]:
    """What each connection from probe pod `name` to the targets (HOST:PORT) did."""
    namespace = PROBES[name][0]
    start = time.monotonic()
    result = kubectl.run("exec", "-n", namespace, name, "--", "python3", "-c", PROBE, str(CONNECT_TIMEOUT_S), *targets,
                         timeout=60 + CONNECT_TIMEOUT_S * len(targets))  # fmt: skip
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(found) == set(targets), (found, targets, time.monotonic() - start)
    return found


def reached(outcomes: dict[str, dict[str, Any]]) -> bool:
    return all(o["outcome"].startswith("connected") for o in outcomes.values())


def denied(outcomes: dict[str, dict[str, Any]]) -> bool:
    """Refused or timed out, each within the connect timeout (and a second of slack)."""
    return all(
        o["outcome"] in ("refused", "timeout") and o["seconds"] <= CONNECT_TIMEOUT_S + 1 for o in outcomes.values()
    )
