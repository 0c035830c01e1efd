"""End to end on a real cluster: an LLMService serving SmolLM2 with LoRA adapters, through the gateway.

The adapters are PEFT directories this test writes (rank 4 on q_proj and v_proj, seeded random
weights: numpy and safetensors, no torch or peft needed) into a directory on this machine, which is
the cluster's only node. A static hostPath PersistentVolume exposes that directory and a claim bound
to it is the adapters' `pvc://` source: the engine pods mount the claim read-only and `lora_sync.py`
loads each listed adapter through the engine's run-time routes. A third adapter added to the running
service (same claim, so no new volume) must be served by the same pods, without a restart.

Self-contained: installs the chart when no release is there (test_e2e.py's last scenario uninstalls
it), and leaves nothing behind, so `make e2e PYTEST_ARGS='-k lora'` runs it alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import CHART, KUBECONFIG, NAMESPACE, RELEASE, RELEASE_VALUES, Kubectl, llmservice, say, scenario, wait_for

SERVICE = "smollm2-lora"
CLAIM = "lora-adapters"
VOLUME = "lockstep-e2e-lora-adapters"
PROMPT = "What is the capital of France?"
READY_TIMEOUT = 900
# SmolLM2-135M: hidden 576, 30 layers, 9 query heads and 3 KV heads of 64.
HIDDEN, LAYERS, Q_OUT, KV_OUT = 576, 30, 9 * 64, 3 * 64
RANK, ALPHA = 4, 16
ADAPTERS = {"alpha": 1, "beta": 2, "gamma": 3}  # name -> seed


def write_adapter(directory: Path, seed: int) -> None:
    """A PEFT LoRA adapter for SmolLM2: rank 4 on q_proj and v_proj of every layer. B is non-zero (a
    zero B, PEFT's default init, would leave the text unchanged) and small enough to keep it sane."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, out in (("q_proj", Q_OUT), ("v_proj", KV_OUT)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((RANK, HIDDEN)) * 0.1).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out, RANK)) * 0.05).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"],
              "bias": "none", "use_rslora": False, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    for path in (directory, *directory.iterdir()):  # the engine runs as uid 65532
        path.chmod(0o755 if path.is_dir() else 0o644)


def adapters_dir() -> Path:
    """On the node's filesystem: beside the cluster's state (KUBECONFIG lies in it), removed with it by
    `cluster.sh down`. The kubelet runs in the cluster's own mount namespace, a copy of this one made
    when the cluster came up, so the directory and files written later in it are the same for both."""
    return Path(KUBECONFIG).resolve().parent / "lora-adapters"


def volume_manifests(path: Path) -> list[dict[str, Any]]:
    """A static hostPath PersistentVolume of `path` (the single node) and a claim bound to it by name."""
    size = {"storage": "64Mi"}
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": VOLUME},
              "spec": {"capacity": size, "accessModes": ["ReadOnlyMany"], "persistentVolumeReclaimPolicy": "Retain",
                       "storageClassName": "", "hostPath": {"path": str(path), "type": "Directory"},
                       "claimRef": {"namespace": NAMESPACE, "name": CLAIM}}}  # fmt: skip
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": NAMESPACE},
             "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": VOLUME,
                      "resources": {"requests": size}}}  # fmt: skip
    return [volume, claim]


def adapter_entry(name: str) -> dict[str, str]:
    return {"name": name, "source": f"pvc://{CLAIM}/{name}"}


def openai_client(port: int):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(port: int, model: str) -> str:
    reply = openai_client(port).chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=16
    )
    return reply.choices[0].message.content or ""


def listed_models(port: int) -> dict[str, Any]:
    return {m.id: m for m in openai_client(port).models.list().data}


def engine_pods(kubectl: Kubectl) -> dict[str, tuple[str, int]]:
    """The service's pods: name -> (uid, restarts of its engine container)."""
    pods = kubectl.json("get", "pods", "-n", NAMESPACE, "-l", f"serving.lockstep.dev/service={SERVICE}")["items"]
    return {p["metadata"]["name"]: (p["metadata"]["uid"], sum(s.get("restartCount", 0) for s in
            p["status"].get("containerStatuses", []))) for p in pods}  # fmt: skip


@pytest.fixture(scope="module")
def release(kubectl: Kubectl, helm_config) -> Iterator[None]:
    """The chart's release: installed here when test_e2e.py's scenarios are not running before (or have
    uninstalled it), and then uninstalled again at the end."""
    installed = kubectl.run("get", "deploy", f"{RELEASE}-gateway", "-n", NAMESPACE, check=False).returncode == 0
    if not installed:
        with scenario("helm install (for the LoRA scenario)"):
            kubectl.run("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                                             "metadata": {"name": NAMESPACE}}))  # fmt: skip
            helm_config.install(str(CHART), RELEASE, RELEASE_VALUES, wait="watcher", timeout=300)
            kubectl.run("wait", "-n", NAMESPACE, "deploy", "--all", "--for=condition=Available", "--timeout=300s",
                        timeout=330)  # fmt: skip
    yield
    if not installed:
        helm_config.uninstall(RELEASE, wait="watcher", timeout=300)


@pytest.fixture(scope="module")
def gateway_port(kubectl: Kubectl, release) -> Iterator[int]:
    with kubectl.port_forward(f"svc/{RELEASE}-gateway", 80) as port:
        yield port


@pytest.fixture(scope="module")
def lora_service(kubectl: Kubectl, release) -> Iterator[None]:
    """The adapters' files, volume and claim, and an LLMService with two of them (alpha and beta)."""
    root = adapters_dir()
    for name, seed in ADAPTERS.items():
        write_adapter(root / name, seed)
    root.chmod(0o755)
    for manifest in volume_manifests(root):
        kubectl.apply(manifest)
    manifest = llmservice(SERVICE)
    manifest["spec"]["lora"] = {"maxLoras": 2, "maxLoraRank": 8}
    manifest["spec"]["loraAdapters"] = [adapter_entry("alpha"), adapter_entry("beta")]
    kubectl.apply(manifest)
    try:
        yield
    finally:
        kubectl.run("delete", "llmservice", SERVICE, "-n", NAMESPACE, "--ignore-not-found", "--wait=true",
                    "--timeout=300s", timeout=330)  # fmt: skip
        kubectl.run("delete", "pvc", CLAIM, "-n", NAMESPACE, "--ignore-not-found", "--wait=true", "--timeout=120s",
                    timeout=150)  # fmt: skip
        kubectl.run("delete", "pv", VOLUME, "--ignore-not-found", "--wait=true", "--timeout=120s", timeout=150)


def test_lora_adapters_from_a_claim_answer_through_the_gateway(kubectl: Kubectl, gateway_port: int, lora_service) -> None:
    with scenario("LoRA: two adapters from a hostPath claim, each answers through the gateway unlike the base model"):
        claim = kubectl.json("get", "pvc", CLAIM, "-n", NAMESPACE)
        say(f"claim {CLAIM}: {claim['status'].get('phase')} to {claim['spec'].get('volumeName')}")
        kubectl.run("wait", "-n", NAMESPACE, f"llmservice/{SERVICE}", "--for=condition=Ready",
                    f"--timeout={READY_TIMEOUT}s", timeout=READY_TIMEOUT + 30)  # fmt: skip
        models = wait_for("the gateway to list both adapters", lambda: (found := listed_models(gateway_port))
                          and {"alpha", "beta"} <= set(found) and found, timeout=180, interval=2)  # fmt: skip
        say("gateway /v1/models: " + ", ".join(f"{m.id} (parent {getattr(m, 'parent', None)})" for m in models.values()))
        for name in ("alpha", "beta"):
            assert getattr(models[name], "parent", None) == SERVICE, models[name]
            assert getattr(models[name], "root", None) == f"/models/{CLAIM}/{name}", models[name]
        base = ask(gateway_port, SERVICE)
        answers = {name: ask(gateway_port, name) for name in ("alpha", "beta")}
        say(f"base: {base!r}; " + "; ".join(f"{name}: {text!r}" for name, text in answers.items()))
        assert base and all(answers.values()), answers
        assert answers["alpha"] != base and answers["beta"] != base, (base, answers)
        assert answers["alpha"] != answers["beta"], answers
        # greedy: the same request gives the same text again (the adapter is not a random perturbation)
        assert ask(gateway_port, "alpha") == answers["alpha"]
        assert ask(gateway_port, SERVICE) == base


def test_a_lora_adapter_added_at_run_time_is_served_without_a_restart(kubectl: Kubectl, gateway_port: int,
                                                                      lora_service) -> None:  # fmt: skip
    with scenario("LoRA: a third adapter patched into the running service is served by the same pods"):
        pods_before = engine_pods(kubectl)
        assert pods_before, "no engine pods"
        entries = [adapter_entry(name) for name in ADAPTERS]
        kubectl.run("patch", "-n", NAMESPACE, f"llmservice/{SERVICE}", "--type=merge",
                    "-p", json.dumps({"spec": {"loraAdapters": entries}}))  # fmt: skip
        # the kubelet replaces the ConfigMap's file within its sync period (about a minute), lora_sync.py
        # loads within 10 s, and the gateway re-reads the engine's /v1/models
        wait_for("the gateway to list gamma", lambda: "gamma" in listed_models(gateway_port), timeout=300, interval=3)
        base = ask(gateway_port, SERVICE)
        gamma = ask(gateway_port, "gamma")
        pods_after = engine_pods(kubectl)
        say(f"base: {base!r}; gamma: {gamma!r}; pods (uid, restarts) before {pods_before}, after {pods_after}")
        assert gamma and gamma != base, (base, gamma)
        assert pods_after == pods_before
        assert {"alpha", "beta", "gamma"} <= set(listed_models(gateway_port))
