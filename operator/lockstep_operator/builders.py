"""ServiceSpec -> the objects around the engine pods. Pure functions, no API calls.

Per replica group i: a headless Service `<name>-g<i>` that gives pod 0 its stable DNS name, and a
NetworkPolicy of the same name that opens every port of the group's pods to the group's pods only
(the group's StatefulSet is built in `pods`). Per LLMService: a Service selecting the leader pods
(what the gateway discovers), a ConfigMap holding the pod launcher, the model fetcher and the engine
arguments, a NetworkPolicy opening engine HTTP to the gateway and to monitoring, a
PodDisruptionBudget, and the group Secret (a random key every rank reads to authenticate the group
channel).
"""

from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Mapping
from typing import Any

from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_SERVED_MODEL,
    ENGINE_PORT,
    GROUP_SECRET_KEY,
    LABEL_ENGINE_CLIENT,
    LABEL_SERVICE,
    RENDEZVOUS_PORT,
)
from lockstep_operator.inpod import FETCHER, LAUNCHER, LORA_SYNC
from lockstep_operator.lora import ADAPTERS_FILE_KEY, adapters_file
from lockstep_operator.names import (
    common_labels,
    configmap_name,
    group_name,
    group_secret_name,
    group_selector,
    leader_selector,
    object_metadata,
    stamp,
)
from lockstep_operator.pods import engine_args
from lockstep_operator.spec import ServiceSpec


def disruption_budget(owner: Mapping[str, Any], spec: ServiceSpec) -> dict[str, Any]:
    """One budget over every engine pod of the service. An eviction stops a whole group (the operator
    restarts a group that lost a pod), and while a group is down its pods count as unavailable, so
    maxUnavailable pods means at most that many groups out at once (fewer when groups span several
    pods). A budget per group could not say this: each would let its own group go, all at once.
    Pods that are not ready anyway (a crash-looping group) never hold a drain up."""
    assert spec.max_disrupted is not None
    return stamp(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": object_metadata(owner, spec.name, common_labels(spec.name)),
            "spec": {
                "maxUnavailable": spec.max_disrupted,
                "selector": {"matchLabels": {LABEL_SERVICE: spec.name}},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    )


def group_service(owner: Mapping[str, Any], spec: ServiceSpec, index: int) -> dict[str, Any]:
    name = group_name(spec.name, index)
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": object_metadata(
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
    metadata = object_metadata(owner, spec.name, labels)
    metadata["annotations"] = {ANNOTATION_SERVED_MODEL: spec.served_name}
    return stamp(
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
    """Mounted whole (no subPath) at /etc/lockstep, so the kubelet brings a changed adapter list
    into running pods (within its sync period, about a minute) without restarting them."""
    data = {
        "launch.py": LAUNCHER,
        "fetch.py": FETCHER,
        "lora_sync.py": LORA_SYNC,
        "args": "\n".join(engine_args(spec)) + "\n",
    }
    if spec.lora is not None:
        data[ADAPTERS_FILE_KEY] = adapters_file(spec.lora)
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": object_metadata(owner, configmap_name(spec.name), common_labels(spec.name)),
            "data": data,
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
        "metadata": object_metadata(owner, group_secret_name(spec.name), common_labels(spec.name)),
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
    return stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_metadata(owner, spec.name, common_labels(spec.name)),
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
    return stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_metadata(
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
