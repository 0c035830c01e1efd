"""ServiceSpec -> the Kubernetes objects that serve it. Pure functions, no API calls.

Per replica group i: a StatefulSet `<name>-g<i>` (one pod per rank slot, all started in parallel,
`OnDelete` so only the operator replaces pods, and then always the whole group), a headless
Service of the same name that gives pod 0 its stable DNS name, and a NetworkPolicy of the same name
that opens every port of the group's pods to the group's pods only. Per LLMService: a Service
selecting the leader pods (what the gateway discovers), a ConfigMap holding the pod launcher and
the model fetcher, a NetworkPolicy opening engine HTTP to the gateway and to monitoring, and the
group Secret (a random key every rank reads to authenticate the group channel).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import secrets
from collections.abc import Mapping
from typing import Any

from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_APPLIED,
    ANNOTATION_SERVED_MODEL,
    ANNOTATION_SURGE,
    API_VERSION,
    CACHE_DIR,
    ENGINE_PORT,
    ENGINE_UID,
    FETCHED_MODELS_DIR,
    GROUP_SECRET_DIR,
    GROUP_SECRET_KEY,
    KIND,
    LABEL_ENGINE_CLIENT,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    LABEL_POD_INDEX,
    LABEL_REVISION,
    LABEL_SERVICE,
    LAUNCHER_DIR,
    MANAGED_BY,
    MODEL_TOKEN_DIR,
    MODELS_DIR,
    RENDEZVOUS_PORT,
    TMP_SIZE_LIMIT,
)
from lockstep_operator.fetcher import FETCHER
from lockstep_operator.launcher import LAUNCHER
from lockstep_operator.spec import ServiceSpec

STARTUP_PROBE_PERIOD_SECONDS = 10
# Workers keep retrying the leader's DNS name this long before failing (and restarting the group).
LEADER_WAIT_SECONDS = 600


def digest(obj: Any, length: int = 10) -> str:
    """A short, stable hash of a JSON-able object."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def group_name(name: str, index: int) -> str:
    return f"{name}-g{index}"


def configmap_name(name: str) -> str:
    return f"{name}-engine"


def group_secret_name(name: str) -> str:
    return f"{name}-group-secret"


def common_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "lockstep-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/part-of": "lockstep",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SERVICE: name,
    }


def group_selector(name: str, index: int) -> dict[str, str]:
    # Only labels the operator owns: selectors are immutable, user labels must never enter them.
    return {LABEL_SERVICE: name, LABEL_GROUP: str(index)}


def leader_selector(name: str) -> dict[str, str]:
    return {LABEL_SERVICE: name, LABEL_POD_INDEX: "0"}


def leader_selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(leader_selector(name).items()))


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def revision(spec: ServiceSpec, namespace: str, config: OperatorConfig) -> str:
    """Hash of everything that shapes a group's pods (group 0 stands for all).

    `replicas` does not enter it: scaling never replaces the pods of existing groups.
    """
    template = _pod_template(spec, namespace, 0, config)
    return digest(
        {"template": template, "pods": spec.pods_per_group, "launcher": LAUNCHER, "fetcher": FETCHER}
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
    # launch.sh computes it from LOCKSTEP_POD_INDEX, which the downward API takes from the pod label.
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
    # spec.engine.env may override the cache variables (LOCKSTEP_* are refused by the spec): one
    # entry per name, since a StatefulSet applied with duplicate env names is rejected.
    overridden = {item["name"] for item in spec.env}
    return [e for e in env if e["name"] not in overridden] + [dict(item) for item in spec.env]


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
    if spec.fetched:
        if spec.model_cache_claim is not None:
            volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.model_cache_claim}})
        else:
            volumes.append({"name": "models", "emptyDir": {}})
        mounts.append({"name": "models", "mountPath": FETCHED_MODELS_DIR, "readOnly": True})
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


def _stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Record the hash of the desired object so an unchanged one is not sent again."""
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED] = digest(obj)
    return obj


def _metadata(owner: Mapping[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }


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
    metadata = _metadata(owner, name, labels)
    if surge:
        metadata["annotations"] = {ANNOTATION_SURGE: "true"}
    return _stamp(
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


def disruption_budget(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    """One budget over every engine pod of the service. An eviction stops a whole group (the operator
    restarts a group that lost a pod), and while a group is down its pods count as unavailable, so
    maxUnavailable pods means at most that many groups out at once (fewer when groups span several
    pods). A budget per group could not say this: each would let its own group go, all at once.
    Pods that are not ready anyway (a crash-looping group) never hold a drain up."""
    assert spec.max_disrupted is not None
    return _stamp(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, spec.name, common_labels(spec.name)),
            "spec": {
                "maxUnavailable": spec.max_disrupted,
                "selector": {"matchLabels": {LABEL_SERVICE: spec.name}},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    )


def group_service(owner: Mapping[str, Any], spec: ServiceSpec, index: int) -> dict[str, Any]:
    name = group_name(spec.name, index)
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(
                owner, name, {**common_labels(spec.name), **group_selector(spec.name, index)}
            ),
            "spec": {
                "clusterIP": "None",
                # Workers must resolve the leader before it is ready: it turns ready only once they joined.
                "publishNotReadyAddresses": True,
                "selector": group_selector(spec.name, index),
                "ports": [
                    {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                    {
                        "name": "rendezvous",
                        "port": RENDEZVOUS_PORT,
                        "targetPort": "rendezvous",
                        "protocol": "TCP",
                    },
                ],
            },
        }
    )


_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def leader_service(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    labels = {**common_labels(spec.name), "app.kubernetes.io/component": "engine-leader"}
    # Also as a label (when it is a valid label value): the EndpointSlice controller copies Service
    # labels onto the slices, so the gateway knows the model even while the service has no group.
    if len(spec.served_name) <= 63 and _LABEL_VALUE_RE.match(spec.served_name):
        labels[ANNOTATION_SERVED_MODEL] = spec.served_name
    metadata = _metadata(owner, spec.name, labels)
    metadata["annotations"] = {ANNOTATION_SERVED_MODEL: spec.served_name}
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": {
                "type": "ClusterIP",
                "selector": leader_selector(spec.name),
                "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )


def engine_configmap(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(owner, configmap_name(spec.name), common_labels(spec.name)),
            "data": {
                "launch.py": LAUNCHER,
                "fetch.py": FETCHER,
                "args": "\n".join(engine_args(spec)) + "\n",
            },
        }
    )


def group_secret(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    """The group channel's shared key. A new random key on every call: it is only ever created
    (never applied), so the first one stays for the life of the LLMService."""
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner, group_secret_name(spec.name), common_labels(spec.name)),
        "data": {GROUP_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def _namespace_peers(namespaces: tuple[str, ...], pods: dict[str, str] | None) -> list[dict[str, Any]]:
    pod_selector = {"podSelector": {"matchLabels": pods}} if pods else {}
    if not namespaces:
        return [{"namespaceSelector": {}, **pod_selector}]
    selector = {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(namespaces)}
        ]
    }
    return [{"namespaceSelector": selector, **pod_selector}]


def engine_http_policy(owner: Mapping[str, Any], spec: ServiceSpec, config: OperatorConfig) -> dict[str, Any]:
    """Engine HTTP from the gateway (pods labelled engine-client) and from monitoring namespaces."""
    peers = _namespace_peers(config.engine_client_namespaces, {LABEL_ENGINE_CLIENT: "true"})
    if config.monitoring_namespaces:
        peers += _namespace_peers(config.monitoring_namespaces, None)
    return _stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(owner, spec.name, common_labels(spec.name)),
            "spec": {
                "podSelector": {"matchLabels": {LABEL_SERVICE: spec.name}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]}],
            },
        }
    )


def group_policy(owner: Mapping[str, Any], spec: ServiceSpec, index: int) -> dict[str, Any]:
    """Every port of a group's pods to the same group's pods only: the rendezvous port and the
    ports torch.distributed opens between ranks (gloo/NCCL pick them at run time)."""
    selector = group_selector(spec.name, index)
    return _stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(
                owner, group_name(spec.name, index), {**common_labels(spec.name), **selector}
            ),
            "spec": {
                "podSelector": {"matchLabels": selector},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": selector}}]}],
            },
        }
    )


def service_objects(
    owner: Mapping[str, Any], spec: ServiceSpec, config: OperatorConfig
) -> list[dict[str, Any]]:
    """The per-LLMService objects applied on every reconcile (the per-group ones are built as
    groups are created; the group Secret is only ever created)."""
    objects = [engine_configmap(owner, spec), leader_service(owner, spec)]
    if config.network_policy:
        objects.append(engine_http_policy(owner, spec, config))
    if spec.max_disrupted is not None:
        objects.append(disruption_budget(owner, spec))
    return objects
