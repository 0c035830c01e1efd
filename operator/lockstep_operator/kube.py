"""The Kubernetes API calls that read an LLMService's world and carry a Plan out."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep_operator.constants import (
    ANNOTATION_APPLIED_GENERATION,
    AUTOSCALER_FIELD_MANAGER,
    FIELD_MANAGER,
    GROUP,
    LABEL_SERVICE,
    PLURAL,
    VERSION,
)
from lockstep_operator.plan import Observed, Plan

log = logging.getLogger(__name__)
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


class Kube:
    """Typed API groups over one ApiClient."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api_client = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.networking = client.NetworkingV1Api(self.api_client)
        self.policy = client.PolicyV1Api(self.api_client)

    def _to_dict(self, obj: Any) -> dict[str, Any]:
        return self.api_client.sanitize_for_serialization(obj)

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list_services(self, namespaces: tuple[str, ...]) -> list[tuple[str, str]]:
        """(namespace, name) of every LLMService in the watched namespaces."""
        if not namespaces:
            items = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        else:
            items = [
                i
                for ns in namespaces
                for i in self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
            ]
        return [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items]

    def observe(self, owner: Mapping[str, Any]) -> Observed:
        """The children of `owner`: labelled with its name and owned by its UID."""
        meta = owner["metadata"]
        namespace, uid = meta["namespace"], meta["uid"]
        selector = f"{LABEL_SERVICE}={meta['name']}"

        def owned(items: list[Any]) -> list[dict[str, Any]]:
            result = []
            for item in items:
                body = self._to_dict(item)
                refs = body["metadata"].get("ownerReferences") or []
                if any(ref.get("uid") == uid for ref in refs):
                    result.append(body)
            return result

        statefulsets = owned(self.apps.list_namespaced_stateful_set(namespace, label_selector=selector).items)
        sts_uids = {s["metadata"]["uid"] for s in statefulsets}
        pods = [
            self._to_dict(p)
            for p in self.core.list_namespaced_pod(namespace, label_selector=selector).items
            if any(ref.uid in sts_uids for ref in p.metadata.owner_references or [])
        ]
        failed_creates = self.core.list_namespaced_event(
            namespace, field_selector="involvedObject.kind=StatefulSet,reason=FailedCreate"
        ).items
        return Observed(
            statefulsets=statefulsets,
            services=owned(self.core.list_namespaced_service(namespace, label_selector=selector).items),
            configmaps=owned(self.core.list_namespaced_config_map(namespace, label_selector=selector).items),
            networkpolicies=owned(
                self.networking.list_namespaced_network_policy(namespace, label_selector=selector).items
            ),
            disruptionbudgets=owned(
                self.policy.list_namespaced_pod_disruption_budget(namespace, label_selector=selector).items
            ),
            pods=pods,
            events=[
                self._to_dict(e)
                for e in failed_creates
                if e.involved_object.uid in sts_uids and e.type == "Warning"
            ],
        )

    def create(self, obj: Mapping[str, Any]) -> None:
        """Create `obj` unless it exists (the group Secret: its key must never change)."""
        assert obj["kind"] == "Secret"
        try:
            self.core.create_namespaced_secret(obj["metadata"]["namespace"], obj, field_manager=FIELD_MANAGER)
        except ApiException as error:
            if error.status != 409:
                raise
            return
        log.info("created Secret %s/%s", obj["metadata"]["namespace"], obj["metadata"]["name"])

    def apply(self, obj: Mapping[str, Any]) -> None:
        kind, name, namespace = obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"]
        patch = {
            "StatefulSet": self.apps.patch_namespaced_stateful_set,
            "Service": self.core.patch_namespaced_service,
            "ConfigMap": self.core.patch_namespaced_config_map,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
            "PodDisruptionBudget": self.policy.patch_namespaced_pod_disruption_budget,
        }[kind]
        result = patch(name, namespace, obj, field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)
        if kind == "StatefulSet":
            generation = str(result.metadata.generation)
            self.annotate_statefulset(namespace, name, {ANNOTATION_APPLIED_GENERATION: generation})

    def delete(self, namespace: str, kind: str, name: str) -> None:
        remove = {
            "StatefulSet": self.apps.delete_namespaced_stateful_set,
            "Service": self.core.delete_namespaced_service,
            "NetworkPolicy": self.networking.delete_namespaced_network_policy,
            "PodDisruptionBudget": self.policy.delete_namespaced_pod_disruption_budget,
        }[kind]
        try:
            remove(name, namespace, propagation_policy="Background")
        except ApiException as error:
            if error.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        # The UID precondition keeps a replacement the StatefulSet already made from being deleted.
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
        try:
            self.core.delete_namespaced_pod(name, namespace, body=options)
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    def annotate_statefulset(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        body = {"metadata": {"annotations": dict(annotations)}}
        self.apps.patch_namespaced_stateful_set(
            name, namespace, body, field_manager=FIELD_MANAGER, _content_type=MERGE
        )

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """spec.replicas through the scale subresource, as an HPA writes it (spec.autoscaling only)."""
        self.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}},
            field_manager=AUTOSCALER_FIELD_MANAGER, _content_type=MERGE,
        )  # fmt: skip

    def pod_ips(self, namespace: str, selector: str) -> list[str]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        return [p.status.pod_ip for p in pods if p.status and p.status.pod_ip and p.status.phase == "Running"]

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)},
            field_manager=FIELD_MANAGER, _content_type=MERGE,
        )  # fmt: skip

    def execute(self, namespace: str, plan: Plan) -> None:
        """Carry out a plan's changes to child objects (status is written separately)."""
        for obj in plan.create:
            self.create(obj)
        for obj in plan.apply:
            log.info("apply %s %s/%s", obj["kind"], namespace, obj["metadata"]["name"])
            self.apply(obj)
        for kind, name in plan.delete:
            log.info("delete %s %s/%s", kind, namespace, name)
            self.delete(namespace, kind, name)
        for name, uid in plan.delete_pods:
            log.info("delete pod %s/%s", namespace, name)
            self.delete_pod(namespace, name, uid)
        for name, marks in plan.annotate:
            self.annotate_statefulset(namespace, name, marks)
