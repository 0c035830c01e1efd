"""Helpers of the end-to-end tests (tests/e2e/conftest.py has the fixtures): polling with a deadline,
scenario lines, kubectl, and the LLMService the scenarios apply.
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
KUBECONFIG = os.environ.get("LOCKSTEP_E2E_KUBECONFIG", "")
NAMESPACE = "lockstep"
RELEASE = "lockstep"
VERSION = "0.1.0"
ENGINE_TAG = f"{VERSION}-cpu"
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
    },
    "operator": {
        "resyncSeconds": 10,
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
    },
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
