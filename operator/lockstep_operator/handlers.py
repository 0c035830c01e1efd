"""kopf wiring: settings, and handlers that only turn events into reconcile requests."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from lockstep_operator.constants import (
    GROUP,
    LABEL_MANAGED_BY,
    LABEL_SERVICE,
    MANAGED_BY,
    PLURAL,
    PREFIX,
    VERSION,
)
from lockstep_operator.reconciler import Reconciler


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # kopf's own bookkeeping, should any handler ever need it, lives under the project's prefix,
    # and never in status: handler results are not stored anywhere.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    # One operator replica (the chart's Deployment uses the Recreate strategy): no peering objects.
    settings.peering.standalone = True
    # The CRD is installed before the operator starts; no need to watch CRDs and namespaces (RBAC).
    settings.scanning.disabled = True
    # kopf posts only its warnings and errors as Kubernetes events; reconcile events are our own.
    settings.posting.level = logging.WARNING
    # Watches are restarted every few minutes, a cheap level-based resync on top of ours.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Watch only the objects the operator made (filtered by the API server).
    managed = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    settings.watching.label_selectors["v1", "pods"] = managed
    settings.watching.label_selectors["apps", "v1", "statefulsets"] = managed
    settings.watching.label_selectors["v1", "services"] = managed
    settings.watching.label_selectors["v1", "configmaps"] = managed
    settings.watching.label_selectors["networking.k8s.io", "v1", "networkpolicies"] = managed
    return settings


def build_registry(reconciler: Reconciler) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    managed = {LABEL_MANAGED_BY: MANAGED_BY}

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the Kubernetes client: in-cluster ServiceAccount or KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def llmservice_event(type: str | None, name: str, namespace: str, **_: Any) -> None:
        if type != "DELETED":
            reconciler.request(namespace, name)

    @kopf.on.event("apps", "v1", "statefulsets", labels=managed, registry=registry)
    def statefulset_event(labels: dict[str, str], namespace: str, **_: Any) -> None:
        if LABEL_SERVICE in labels:
            reconciler.request(namespace, labels[LABEL_SERVICE])

    @kopf.on.event("", "v1", "pods", labels=managed, registry=registry)
    def pod_event(labels: dict[str, str], namespace: str, **_: Any) -> None:
        if LABEL_SERVICE in labels:
            reconciler.request(namespace, labels[LABEL_SERVICE])

    @kopf.on.event("", "v1", "services", labels=managed, registry=registry)
    def service_event(type: str | None, labels: dict[str, str], namespace: str, **_: Any) -> None:
        if type == "DELETED" and LABEL_SERVICE in labels:  # only a deletion needs repair
            reconciler.request(namespace, labels[LABEL_SERVICE])

    @kopf.on.event("", "v1", "configmaps", labels=managed, registry=registry)
    def configmap_event(type: str | None, labels: dict[str, str], namespace: str, **_: Any) -> None:
        if type == "DELETED" and LABEL_SERVICE in labels:
            reconciler.request(namespace, labels[LABEL_SERVICE])

    @kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=managed, registry=registry)
    def networkpolicy_event(type: str | None, labels: dict[str, str], namespace: str, **_: Any) -> None:
        if type == "DELETED" and LABEL_SERVICE in labels:
            reconciler.request(namespace, labels[LABEL_SERVICE])

    return registry
