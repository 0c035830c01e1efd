"""Observed objects -> what to change and what status to report. Pure: no API calls, no clock.

Rules (DESIGN.md section 5.2):
* groups missing below `spec.replicas` are created at the current revision, groups at or above it
  are deleted: scaling never touches the pods of the other groups;
* a group whose pods run an older revision is replaced as a whole, one available group at a time
  (a group that is not available anyway is replaced at once);
* a group in which any pod restarted, failed, or was deleted or replaced is restarted as a whole:
  a TP/PP group cannot survive a lost rank. The pod UIDs of a complete group are recorded on its
  StatefulSet; a mismatch later means a member was lost;
* status is recomputed from what exists every time; `spec` is never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep_operator import builders
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_APPLIED,
    ANNOTATION_APPLIED_GENERATION,
    ANNOTATION_MEMBERS,
    ANNOTATION_RESTARTS,
    LABEL_GROUP,
    LABEL_REVISION,
)
from lockstep_operator.spec import ServiceSpec, SpecError, parse_spec


@dataclass(frozen=True)
class Observed:
    """The LLMService's children as listed from the API server (only those it owns)."""

    statefulsets: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    configmaps: Sequence[Mapping[str, Any]] = ()
    pods: Sequence[Mapping[str, Any]] = ()


@dataclass
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)  # server-side apply, in order
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    delete_pods: list[tuple[str, str]] = field(default_factory=list)  # (name, uid precondition)
    annotate: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (StatefulSet, annotations)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    status: dict[str, Any] = field(default_factory=dict)
    group_restarts: int = 0
    group_updates: int = 0


@dataclass
class Group:
    index: int
    statefulset: Mapping[str, Any] | None
    pods: list[Mapping[str, Any]]  # live (not terminating) pods
    state: str = ""
    ready: bool = False
    updated: bool = False
    restarts: int = 0


# --- pod and object facts -------------------------------------------------------------------


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def _name(obj: Mapping[str, Any]) -> str:
    return obj["metadata"]["name"]


def _group_index(obj: Mapping[str, Any]) -> int | None:
    value = _labels(obj).get(LABEL_GROUP, "")
    return int(value) if value.isdigit() else None


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_restart_count(pod: Mapping[str, Any]) -> int:
    status = pod.get("status") or {}
    statuses = (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
    return sum(int(s.get("restartCount") or 0) for s in statuses)


def recorded_members(statefulset: Mapping[str, Any]) -> set[str]:
    value = _annotations(statefulset).get(ANNOTATION_MEMBERS, "")
    return {uid for uid in value.split(",") if uid}


def lost_member(group: Group) -> str | None:
    """Why the group can no longer run as one, or None."""
    for pod in group.pods:
        if (pod.get("status") or {}).get("phase") == "Failed":
            return f"pod {_name(pod)} failed"
        if pod_restart_count(pod) > 0:
            return f"pod {_name(pod)} restarted"
    members = recorded_members(group.statefulset or {})
    if not members:
        return None
    replaced = [_name(p) for p in group.pods if p["metadata"]["uid"] not in members]
    if replaced:
        return f"pod {replaced[0]} was replaced"
    lost = len(members - {pod["metadata"]["uid"] for pod in group.pods})
    if lost:
        return f"{lost} of its pods {'was' if lost == 1 else 'were'} deleted"
    return None


# --- conditions -----------------------------------------------------------------------------


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(
    new: list[dict[str, Any]], old: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Keep lastTransitionTime when a condition's status did not change."""
    previous = {c.get("type"): c for c in old or ()}
    merged = []
    for condition in new:
        before = previous.get(condition["type"])
        unchanged = before is not None and before.get("status") == condition["status"]
        stamp = before.get("lastTransitionTime") if unchanged and before else None
        merged.append({**condition, "lastTransitionTime": stamp or now})
    return merged


def _status_conditions(
    spec: ServiceSpec, groups: list[Group], existing: int, generation: int
) -> list[dict[str, Any]]:
    desired = spec.replicas
    ready = sum(g.ready for g in groups)
    updated = sum(g.updated for g in groups)
    restarting = [g for g in groups if g.state == "Restarting"]
    counts = f"{ready} of {desired} groups ready, {updated} updated"
    if desired == 0:
        ready_c = _condition("Ready", existing == 0, "ScaledToZero", "spec.replicas is 0", generation)
        available = _condition("Available", False, "ScaledToZero", "spec.replicas is 0", generation)
    else:
        all_ready = ready == desired and updated == desired and existing == desired
        ready_c = _condition(
            "Ready", all_ready, "AllGroupsReady" if all_ready else "GroupsNotReady", counts, generation
        )
        available = _condition(
            "Available", ready > 0, "GroupsAvailable" if ready else "NoGroupReady", counts, generation
        )
    if existing != desired:
        progressing = _condition(
            "Progressing", True, "Scaling", f"{existing} groups, scaling to {desired}", generation
        )
    elif updated < desired:
        progressing = _condition(
            "Progressing", True, "RollingUpdate", f"{updated} of {desired} groups updated", generation
        )
    elif ready < desired:
        progressing = _condition("Progressing", True, "GroupsStarting", counts, generation)
    else:
        progressing = _condition("Progressing", False, "Complete", counts, generation)
    if restarting:
        message = "; ".join(f"group {g.index} restarting" for g in restarting)
        degraded = _condition("Degraded", True, "GroupRestarting", message, generation)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "", generation)
    return [ready_c, available, progressing, degraded]


def invalid_spec_status(owner: Mapping[str, Any], error: SpecError, now: str) -> dict[str, Any]:
    generation = owner["metadata"].get("generation", 0)
    old = owner.get("status") or {}
    message = str(error)
    conditions = [
        _condition("Ready", False, "InvalidSpec", message, generation),
        _condition(
            "Available",
            bool(old.get("readyReplicas")),
            "InvalidSpec",
            "existing groups are left as they are until the spec is fixed",
            generation,
        ),
        _condition("Progressing", False, "InvalidSpec", message, generation),
        _condition("Degraded", True, "InvalidSpec", message, generation),
    ]
    return {
        **old,
        "observedGeneration": generation,
        "conditions": merge_conditions(conditions, old.get("conditions", []), now),
    }


def error_status(owner: Mapping[str, Any], message: str, now: str) -> dict[str, Any]:
    """Status after a reconcile failed: the rest of the last status stays, Degraded says why."""
    old = owner.get("status") or {}
    generation = owner["metadata"].get("generation", 0)
    conditions = [c for c in old.get("conditions") or [] if c.get("type") != "Degraded"]
    conditions.append(_condition("Degraded", True, "ReconcileError", message, generation))
    return {**old, "conditions": merge_conditions(conditions, old.get("conditions", []), now)}


# --- the plan -------------------------------------------------------------------------------


def _needs_apply(desired: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    if current is None:
        return True
    if _annotations(current).get(ANNOTATION_APPLIED) != _annotations(desired)[ANNOTATION_APPLIED]:
        return True
    applied_generation = _annotations(current).get(ANNOTATION_APPLIED_GENERATION)
    return applied_generation is not None and applied_generation != str(current["metadata"].get("generation"))


def _group_view(group: Group, spec: ServiceSpec, target: str) -> None:
    sts_revision = _labels(group.statefulset or {}).get(LABEL_REVISION)
    pods_consistent = all(_labels(p).get(LABEL_REVISION) == sts_revision for p in group.pods)
    complete = len(group.pods) == spec.pods_per_group
    group.restarts = int(_annotations(group.statefulset or {}).get(ANNOTATION_RESTARTS, "0") or 0)
    group.updated = sts_revision == target and pods_consistent
    group.ready = complete and pods_consistent and all(is_pod_ready(p) for p in group.pods)
    group.state = "Ready" if group.ready else "Starting"


def _replace_pods(plan: Plan, group: Group, annotations: dict[str, str]) -> None:
    """Delete every live pod of the group (the StatefulSet recreates them together)."""
    assert group.statefulset is not None
    plan.delete_pods += [(_name(p), p["metadata"]["uid"]) for p in group.pods]
    plan.annotate.append((_name(group.statefulset), annotations))
    group.pods = []
    group.ready = False


def plan_reconcile(owner: Mapping[str, Any], observed: Observed, config: OperatorConfig, now: str) -> Plan:
    """Everything one reconcile of `owner` (an LLMService object) should do."""
    meta = owner["metadata"]
    try:
        spec = parse_spec(meta["name"], owner.get("spec") or {}, default_image=config.engine_image)
    except SpecError as error:
        status = invalid_spec_status(owner, error, now)
        ready_before = next(
            (c for c in (owner.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {}
        )
        reported = ready_before.get("reason") == "InvalidSpec" and ready_before.get("message") == str(error)
        return Plan(status=status, events=[] if reported else [("Warning", "InvalidSpec", str(error))])

    plan = Plan()
    namespace = meta["namespace"]
    target = builders.revision(spec, namespace, config)

    services = {_name(s): s for s in observed.services}
    configmaps = {_name(c): c for c in observed.configmaps}
    for obj in builders.service_objects(owner, spec):
        pool = configmaps if obj["kind"] == "ConfigMap" else services
        if _needs_apply(obj, pool.get(_name(obj))):
            plan.apply.append(obj)

    statefulsets: dict[int, Mapping[str, Any]] = {}
    for sts in observed.statefulsets:
        index = _group_index(sts)
        if index is not None:
            statefulsets[index] = sts
    pods_by_group: dict[int, list[Mapping[str, Any]]] = {}
    for pod in observed.pods:
        index = _group_index(pod)
        if index is not None and not is_terminating(pod):
            pods_by_group.setdefault(index, []).append(pod)

    # Scale down: whole groups above spec.replicas go, highest first; their pods go with them (GC).
    for index in sorted(statefulsets, reverse=True):
        if index >= spec.replicas:
            plan.delete.append(("StatefulSet", _name(statefulsets[index])))
    for name, svc in services.items():
        index = _group_index(svc)
        if index is not None and index >= spec.replicas:
            plan.delete.append(("Service", name))

    groups = [
        Group(i, statefulsets.get(i), sorted(pods_by_group.get(i, []), key=_name))
        for i in range(spec.replicas)
    ]
    for group in groups:
        desired_svc = builders.group_service(owner, spec, group.index)
        if _needs_apply(desired_svc, services.get(_name(desired_svc))):
            plan.apply.append(desired_svc)
        if group.statefulset is None:
            plan.apply.append(builders.group_statefulset(owner, spec, group.index, config))
            group.state = "Creating"
            continue
        _group_view(group, spec, target)
        reason = lost_member(group)
        if reason is not None:
            group.restarts += 1
            plan.events.append(("Warning", "GroupRestart", f"restarting group {group.index}: {reason}"))
            plan.group_restarts += 1
            _replace_pods(plan, group, {ANNOTATION_MEMBERS: "", ANNOTATION_RESTARTS: str(group.restarts)})
            group.state = "Restarting"
            continue
        sts_revision = _labels(group.statefulset).get(LABEL_REVISION)
        if sts_revision == target and not group.updated and group.pods:
            # Pods made from the previous template after the update (the StatefulSet controller
            # had not seen it yet): replace them too, the group must run one revision.
            _replace_pods(plan, group, {ANNOTATION_MEMBERS: ""})
            group.state = "Updating"
            continue
        if sts_revision == target:
            desired_sts = builders.group_statefulset(owner, spec, group.index, config)
            if (
                _needs_apply(desired_sts, group.statefulset)
                or group.statefulset["spec"]["replicas"] != spec.pods_per_group
            ):
                plan.apply.append(desired_sts)  # same revision: pods are not touched
        if (
            sts_revision == target
            and not recorded_members(group.statefulset)
            and len(group.pods) == spec.pods_per_group
        ):
            plan.annotate.append(
                (
                    _name(group.statefulset),
                    {ANNOTATION_MEMBERS: ",".join(sorted(p["metadata"]["uid"] for p in group.pods))},
                )
            )
        if sts_revision != target:
            group.state = "Outdated"

    # Rolling update: outdated groups that are down anyway go now; an available one only when
    # every other group is available, so at most one group is out of service for the update.
    outdated = [g for g in groups if g.state == "Outdated"]
    all_available = all(g.ready for g in groups)
    budget = 1 if all_available else 0
    for group in outdated:
        if group.ready:
            if budget == 0:
                continue
            budget -= 1
        plan.apply.append(builders.group_statefulset(owner, spec, group.index, config))
        _replace_pods(plan, group, {ANNOTATION_MEMBERS: ""})
        group.state = "Updating"
        plan.group_updates += 1
        plan.events.append(("Normal", "GroupUpdate", f"replacing group {group.index} with revision {target}"))

    old = owner.get("status") or {}
    conditions = _status_conditions(spec, groups, len(statefulsets), meta.get("generation", 0))
    plan.status = {
        "observedGeneration": meta.get("generation", 0),
        "replicas": len(statefulsets),
        "readyReplicas": sum(g.ready for g in groups),
        "updatedReplicas": sum(g.updated for g in groups),
        "selector": builders.leader_selector_string(spec.name),
        "podsPerGroup": spec.pods_per_group,
        "steps": spec.steps,
        "conditions": merge_conditions(conditions, old.get("conditions", []), now),
        "groups": [
            {
                "index": g.index,
                "leader": f"{builders.group_name(spec.name, g.index)}-0",
                "state": g.state,
                "ready": g.ready,
                "readyPods": sum(is_pod_ready(p) for p in g.pods),
                "updated": g.updated,
                "restarts": g.restarts,
            }
            for g in groups
        ],
    }
    return plan


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether `new` says anything `old` does not (transition times aside)."""

    def strip(status: Mapping[str, Any] | None) -> dict[str, Any]:
        status = dict(status or {})
        status["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
        ]
        return status

    return strip(old) != strip(new)
