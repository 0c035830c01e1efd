"""ServiceSpec -> a replica group's StatefulSet and its pod template. Pure functions, no API calls.

Per replica group i: a StatefulSet `<name>-g<i>`, one pod per rank slot, all started in parallel,
`OnDelete` so only the operator replaces pods, and then always the whole group. Every pod runs the
launcher from the LLMService's ConfigMap; a model fetched from hf:// or a URL comes first through
the `fetch-model` init container. The group revision hashes everything that shapes the pods; the LoRA
adapter list is not part of it (the pods read it from the ConfigMap at run time, see `lora`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_SURGE,
    CACHE_DIR,
    ENGINE_PORT,
    ENGINE_UID,
    FETCHED_MODELS_DIR,
    GROUP_SECRET_DIR,
    GROUP_SECRET_KEY,
    LABEL_POD_INDEX,
    LABEL_REVISION,
    LAUNCHER_DIR,
    MODEL_TOKEN_DIR,
    MODELS_DIR,
    RENDEZVOUS_PORT,
    TMP_SIZE_LIMIT,
)
from lockstep_operator.inpod import FETCHER, LAUNCHER, LORA_SYNC
from lockstep_operator.lora import ADAPTERS_FILE_KEY
from lockstep_operator.lora import engine_args as lora_args
from lockstep_operator.names import (
    common_labels,
    configmap_name,
    digest,
    group_name,
    group_secret_name,
    group_selector,
    object_metadata,
    stamp,
    volume_name,
)
from lockstep_operator.spec import ServiceSpec

STARTUP_PROBE_PERIOD_SECONDS = 10
# Workers keep retrying the leader's DNS name this long before failing (and restarting the group).
LEADER_WAIT_SECONDS = 600


def revision(spec: ServiceSpec, namespace: str, config: OperatorConfig) -> str:
    """Hash of everything that shapes a group's pods (group 0 stands for all).

    `replicas` does not enter it: scaling never replaces the pods of existing groups.
    """
    template = _pod_template(spec, namespace, 0, config)
    return digest(
        {"template": template, "pods": spec.pods_per_group, "launcher": LAUNCHER, "fetcher": FETCHER,
         "lora_sync": LORA_SYNC}
    )


def fetched_model_dir(spec: ServiceSpec) -> str:
    """One directory per source, so LLMServices sharing a cache claim share downloads."""
    return f"{FETCHED_MODELS_DIR}/{digest(spec.source, 16)}"


def model_arg(spec: ServiceSpec) -> str:
    if spec.fetched:
        directory = fetched_model_dir(spec)
        if spec.source.startswith("hf://"):
            return directory
        name = spec.source.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        return directory if name.endswith((".tar", ".tar.gz", ".tgz")) else f"{directory}/{name}"
    claim = spec.pvc_claim
    if claim is None:
        return spec.source
    return f"{MODELS_DIR}/{claim}" + spec.source[len("pvc://") + len(claim) :]


def engine_args(spec: ServiceSpec) -> list[str]:
    """Arguments of `lockstep serve` (leader) and `lockstep worker` (other ranks) alike."""
    args = [
        model_arg(spec),
        "--port", str(ENGINE_PORT),
        "--served-model-name", spec.served_name,
        "--num-scheduler-steps", spec.steps,
        "--tensor-parallel-size", str(spec.tensor),
        "--pipeline-parallel-size", str(spec.pipeline),
    ]  # fmt: skip
    if spec.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.speculative_config is not None:
        args += ["--speculative-config", spec.speculative_config]
    if spec.lora is not None:
        args += lora_args(spec.lora)
    # The engine drains on SIGTERM (new requests get a retryable 503, running ones finish) for this
    # long, then aborts what is left; the rest of the pod's grace period is for the abort and the exit.
    args += ["--shutdown-grace-period", str(drain_seconds(spec))]
    return args + list(spec.extra_args)


def drain_seconds(spec: ServiceSpec) -> int:
    return max(spec.termination_grace_seconds - 10, spec.termination_grace_seconds // 2)


def leader_address(spec: ServiceSpec, namespace: str, index: int, config: OperatorConfig) -> str:
    group = group_name(spec.name, index)
    return f"{group}-0.{group}.{namespace}.svc.{config.cluster_domain}"


def engine_env(spec: ServiceSpec, namespace: str, index: int, config: OperatorConfig) -> list[dict[str, Any]]:
    # LOCKSTEP_RANK = pod index x ranks per pod (+ local rank, added by the engine inside the pod):
    # launch.py computes it from LOCKSTEP_POD_INDEX, which the downward API takes from the pod label.
    pod_index = {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_POD_INDEX}']"}}
    env = [
        {"name": "LOCKSTEP_POD_INDEX", "valueFrom": pod_index},
        {"name": "LOCKSTEP_RANKS_PER_POD", "value": str(spec.ranks_per_pod)},
        {"name": "LOCKSTEP_WORLD_SIZE", "value": str(spec.world_size)},
        {"name": "LOCKSTEP_LEADER_ADDR", "value": leader_address(spec, namespace, index, config)},
        {"name": "LOCKSTEP_HTTP_PORT", "value": str(ENGINE_PORT)},
        {"name": "LOCKSTEP_RENDEZVOUS_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "LOCKSTEP_GROUP", "value": str(index)},
        {"name": "LOCKSTEP_LEADER_WAIT_SECONDS", "value": str(LEADER_WAIT_SECONDS)},
        {"name": "LOCKSTEP_GROUP_SECRET_FILE", "value": f"{GROUP_SECRET_DIR}/{GROUP_SECRET_KEY}"},
        *cache_env(),
    ]
    if spec.api_key_secret is not None:
        ref = {"name": spec.api_key_secret.name, "key": spec.api_key_secret.key}
        env.append({"name": "LOCKSTEP_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    if spec.lora is not None:
        env += lora_env(spec)
    # spec.engine.env may override the cache variables (LOCKSTEP_* are refused by the spec): one
    # entry per name, since a StatefulSet applied with duplicate env names is rejected.
    overridden = {item["name"] for item in spec.env}
    return [e for e in env if e["name"] not in overridden] + [dict(item) for item in spec.env]


def lora_env(spec: ServiceSpec) -> list[dict[str, str]]:
    """What the launcher's lora_sync.py needs: the adapter list, and what fetch.py needs for hf:// and URLs."""
    env = [
        # The engine's run-time routes (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), as in vLLM.
        {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"},
        {"name": "LOCKSTEP_LORA_ADAPTERS_FILE", "value": f"{LAUNCHER_DIR}/{ADAPTERS_FILE_KEY}"},
    ]
    if spec.model_endpoint:
        env.append({"name": "LOCKSTEP_LORA_HF_ENDPOINT", "value": spec.model_endpoint})
    if spec.model_token_secret is not None:
        env.append({"name": "LOCKSTEP_MODEL_TOKEN_FILE", "value": f"{MODEL_TOKEN_DIR}/token"})
    return env


def cache_env() -> list[dict[str, str]]:
    """HOME and the caches of everything in the engine image, inside the writable cache volume."""
    return [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "LOCKSTEP_CACHE", "value": f"{CACHE_DIR}/lockstep"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/torchinductor"},
    ]


def launch_command() -> list[str]:
    return ["python3", f"{LAUNCHER_DIR}/launch.py"]


def _probe_command() -> list[str]:
    return [*launch_command(), "--probe"]


def probes(spec: ServiceSpec) -> dict[str, Any]:
    """Leader-only health checks: on other ranks the launcher's probe succeeds without a request.

    One StatefulSet template serves every rank of a group, so the probe itself tells the leader
    (pod index 0, which serves GET /health) from the workers (which serve no HTTP).
    """
    startup_failures = math.ceil(spec.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS)
    return {
        "startupProbe": {
            "exec": {"command": _probe_command()},
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": startup_failures,
        },
        "readinessProbe": {
            "exec": {"command": _probe_command()},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "exec": {"command": _probe_command()},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def shm_size(spec: ServiceSpec) -> str:
    return spec.shm_size or f"{2 * spec.ranks_per_pod}Gi"


def container_resources(spec: ServiceSpec) -> dict[str, Any]:
    result = {key: dict(value) for key, value in spec.resources.items()}
    if spec.gpus_per_pod:
        limits = result.setdefault("limits", {})
        limits.setdefault("nvidia.com/gpu", spec.gpus_per_pod)
    return result


def _volumes(spec: ServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(spec)}},
        {"name": "launcher", "configMap": {"name": configmap_name(spec.name), "defaultMode": 0o444}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
        {
            "name": "group-secret",
            "secret": {"secretName": group_secret_name(spec.name), "defaultMode": 0o440},
        },
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "launcher", "mountPath": LAUNCHER_DIR, "readOnly": True},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "group-secret", "mountPath": GROUP_SECRET_DIR, "readOnly": True},
    ]
    claim = spec.pvc_claim
    if claim is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True})
    for adapter_claim in spec.lora.claims if spec.lora is not None else ():
        if adapter_claim != claim:
            name = volume_name("lora", adapter_claim)
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": adapter_claim, "readOnly": True}})
            mounts.append({"name": name, "mountPath": f"{MODELS_DIR}/{adapter_claim}", "readOnly": True})
    if spec.fetched:
        if spec.model_cache_claim is not None:
            volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.model_cache_claim}})
        else:
            volumes.append({"name": "models", "emptyDir": {}})
        mounts.append({"name": "models", "mountPath": FETCHED_MODELS_DIR, "readOnly": True})
    # The token fetches the model (the init container) and the hf:// and URL adapters (lora_sync.py).
    if spec.fetched or spec.lora is not None:
        if spec.model_token_secret is not None:
            secret = spec.model_token_secret
            volumes.append(
                {
                    "name": "model-token",
                    "secret": {
                        "secretName": secret.name,
                        "items": [{"key": secret.key, "path": "token"}],
                        "defaultMode": 0o440,
                    },
                }
            )
            if spec.lora is not None:
                mounts.append({"name": "model-token", "mountPath": MODEL_TOKEN_DIR, "readOnly": True})
    return volumes, mounts


def security_context() -> dict[str, Any]:
    """Every container: the Pod Security Standard "restricted" profile, and a read-only root."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_UID,
        # Secret and cache volumes become readable and writable by the engine's group.
        "fsGroup": ENGINE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def fetch_container(spec: ServiceSpec) -> dict[str, Any]:
    """The init container that puts an hf:// or URL model into the models volume (once per cache)."""
    env = [
        {"name": "LOCKSTEP_MODEL_SOURCE", "value": spec.source},
        {"name": "LOCKSTEP_MODEL_DIR", "value": fetched_model_dir(spec)},
        *cache_env(),
    ]
    mounts = [
        {"name": "launcher", "mountPath": LAUNCHER_DIR, "readOnly": True},
        {"name": "models", "mountPath": FETCHED_MODELS_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.model_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": spec.model_endpoint})
    if spec.model_token_secret is not None:
        env.append({"name": "LOCKSTEP_MODEL_TOKEN_FILE", "value": f"{MODEL_TOKEN_DIR}/token"})
        mounts.append({"name": "model-token", "mountPath": MODEL_TOKEN_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": "fetch-model",
        "image": spec.image,
        "command": ["python3", f"{LAUNCHER_DIR}/fetch.py"],
        "env": env,
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return container


_TEMPLATE_POD_FIELDS = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "topologySpreadConstraints",
    "priorityClassName",
    "serviceAccountName",
    "schedulerName",
    "runtimeClassName",
    "imagePullSecrets",
)


def _pod_template(spec: ServiceSpec, namespace: str, index: int, config: OperatorConfig) -> dict[str, Any]:
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image,
        "command": launch_command(),
        "args": engine_args(spec),
        "env": engine_env(spec, namespace, index, config),
        "ports": [
            {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        ],
        "resources": container_resources(spec),
        "volumeMounts": mounts,
        "securityContext": security_context(),
        # A container that fails leaves the tail of its log as its termination message: the operator
        # puts the engine's last error line into the LLMService's status (groups.termination).
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **probes(spec),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    template = spec.template
    labels = {
        **dict(template.get("labels") or {}),
        **common_labels(spec.name),
        **group_selector(spec.name, index),
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
        # Engines never call the Kubernetes API (a template.serviceAccountName still applies).
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": spec.termination_grace_seconds,
    }
    if spec.fetched:
        pod_spec["initContainers"] = [fetch_container(spec)]
    pod_spec.update({key: template[key] for key in _TEMPLATE_POD_FIELDS if template.get(key)})
    metadata: dict[str, Any] = {"labels": labels}
    if template.get("annotations"):
        metadata["annotations"] = dict(template["annotations"])
    return {"metadata": metadata, "spec": pod_spec}


def pod_template(spec: ServiceSpec, namespace: str, index: int, config: OperatorConfig) -> dict[str, Any]:
    template = _pod_template(spec, namespace, index, config)
    template["metadata"]["labels"][LABEL_REVISION] = revision(spec, namespace, config)
    return template


def group_statefulset(
    owner: Mapping[str, Any], spec: ServiceSpec, index: int, config: OperatorConfig, surge: bool = False
) -> dict[str, Any]:
    """Group `index`'s StatefulSet; `surge` marks an extra group of a rolling update."""
    namespace = owner["metadata"]["namespace"]
    name = group_name(spec.name, index)
    labels = {
        **common_labels(spec.name),
        **group_selector(spec.name, index),
        LABEL_REVISION: revision(spec, namespace, config),
    }
    metadata = object_metadata(owner, name, labels)
    if surge:
        metadata["annotations"] = {ANNOTATION_SURGE: "true"}
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": metadata,
            "spec": {
                "replicas": spec.pods_per_group,
                "serviceName": name,
                "podManagementPolicy": "Parallel",
                "updateStrategy": {"type": "OnDelete"},
                "selector": {"matchLabels": group_selector(spec.name, index)},
                "template": pod_template(spec, namespace, index, config),
            },
        }
    )
