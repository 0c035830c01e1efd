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
from lockstep_operator.conditions import invalid_spec_status, merge_conditions, status_conditions
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_APPLIED,
    ANNOTATION_APPLIED_GENERATION,
    ANNOTATION_MEMBERS,
    ANNOTATION_RESTARTS,
    LABEL_REVISION,
)
from lockstep_operator.groups import (
    Group,
    annotations_of,
    group_index,
    group_problem,
    is_pod_ready,
    is_terminating,
    labels_of,
    lost_member,
    name_of,
    recorded_members,
)
from lockstep_operator.spec import ServiceSpec, SpecError, parse_spec


@dataclass(frozen=True)
class Observed:
    """The LLMService's children as listed from the API server (only those it owns)."""

    statefulsets: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    configmaps: Sequence[Mapping[str, Any]] = ()
    networkpolicies: Sequence[Mapping[str, Any]] = ()
    pods: Sequence[Mapping[str, Any]] = ()
    # Warning events of reason FailedCreate on its StatefulSets: why the controller made no pod.
    events: Sequence[Mapping[str, Any]] = ()


@dataclass
class Plan:
    create: list[dict[str, Any]] = field(default_factory=list)  # created when absent, never changed
    apply: list[dict[str, Any]] = field(default_factory=list)  # server-side apply, in order
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    delete_pods: list[tuple[str, str]] = field(default_factory=list)  # (name, uid precondition)
    annotate: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (StatefulSet, annotations)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    status: dict[str, Any] = field(default_factory=dict)
    group_restarts: int = 0
    group_updates: int = 0


# --- the plan: one named step per rule -----------------------------------------------------


def _needs_apply(desired: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    if current is None:
        return True
    if annotations_of(current).get(ANNOTATION_APPLIED) != annotations_of(desired)[ANNOTATION_APPLIED]:
        return True
    applied_generation = annotations_of(current).get(ANNOTATION_APPLIED_GENERATION)
    return applied_generation is not None and applied_generation != str(current["metadata"].get("generation"))


def _apply_if_changed(plan: Plan, desired: dict[str, Any], current: Mapping[str, Any] | None) -> None:
    if _needs_apply(desired, current):
        plan.apply.append(desired)


def _group_view(group: Group, spec: ServiceSpec, target: str) -> None:
    sts_revision = labels_of(group.statefulset or {}).get(LABEL_REVISION)
    pods_consistent = all(labels_of(p).get(LABEL_REVISION) == sts_revision for p in group.pods)
    complete = len(group.pods) == spec.pods_per_group
    group.restarts = int(annotations_of(group.statefulset or {}).get(ANNOTATION_RESTARTS, "0") or 0)
    group.updated = sts_revision == target and pods_consistent
    group.ready = complete and pods_consistent and all(is_pod_ready(p) for p in group.pods)
    group.state = "Ready" if group.ready else "Starting"


def _replace_pods(plan: Plan, group: Group, annotations: dict[str, str]) -> None:
    """Delete every live pod of the group (the StatefulSet recreates them together)."""
    assert group.statefulset is not None
    plan.delete_pods += [(name_of(p), p["metadata"]["uid"]) for p in group.pods]
    plan.annotate.append((name_of(group.statefulset), annotations))
    group.pods = []
    group.ready = False


@dataclass
class _Context:
    """What every step of one reconcile reads."""

    owner: Mapping[str, Any]
    spec: ServiceSpec
    config: OperatorConfig
    target: str  # the revision every group should run
    services: dict[str, Mapping[str, Any]]
    policies: dict[str, Mapping[str, Any]]
    statefulsets: dict[int, Mapping[str, Any]]


def _invalid_spec_plan(owner: Mapping[str, Any], error: SpecError, now: str) -> Plan:
    """Report the spec error once (as an event) and in status; touch nothing that runs."""
    ready_before = next(
        (c for c in (owner.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {}
    )
    reported = ready_before.get("reason") == "InvalidSpec" and ready_before.get("message") == str(error)
    return Plan(
        status=invalid_spec_status(owner, error, now),
        events=[] if reported else [("Warning", "InvalidSpec", str(error))],
    )


def _by_group(objects: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    result: dict[int, list[Mapping[str, Any]]] = {}
    for obj in objects:
        index = group_index(obj)
        if index is not None:
            result.setdefault(index, []).append(obj)
    return result


def _apply_service_objects(plan: Plan, ctx: _Context, observed: Observed) -> None:
    """The ConfigMap, the leader Service, the HTTP NetworkPolicy; the group Secret if absent."""
    plan.create.append(builders.group_secret(ctx.owner, ctx.spec))
    configmaps = {name_of(c): c for c in observed.configmaps}
    pools = {"ConfigMap": configmaps, "Service": ctx.services, "NetworkPolicy": ctx.policies}
    for obj in builders.service_objects(ctx.owner, ctx.spec, ctx.config):
        _apply_if_changed(plan, obj, pools[obj["kind"]].get(name_of(obj)))


def _delete_unwanted(plan: Plan, ctx: _Context) -> None:
    """Scale down: whole groups above spec.replicas go, highest first (their pods go with them,
    by garbage collection), with their Services and NetworkPolicies; and every NetworkPolicy
    once policies are turned off."""
    replicas = ctx.spec.replicas
    for index in sorted(ctx.statefulsets, reverse=True):
        if index >= replicas:
            plan.delete.append(("StatefulSet", name_of(ctx.statefulsets[index])))
    for name, svc in ctx.services.items():
        index = group_index(svc)
        if index is not None and index >= replicas:
            plan.delete.append(("Service", name))
    for name, policy in ctx.policies.items():
        index = group_index(policy)
        if not ctx.config.network_policy or (index is not None and index >= replicas):
            plan.delete.append(("NetworkPolicy", name))


def _restart_if_member_lost(plan: Plan, group: Group) -> bool:
    """A TP/PP group cannot survive a lost rank: replace every pod. True when it did."""
    reason = lost_member(group)
    if reason is None:
        return False
    group.restarts += 1
    plan.events.append(("Warning", "GroupRestart", f"restarting group {group.index}: {reason}"))
    plan.group_restarts += 1
    _replace_pods(plan, group, {ANNOTATION_MEMBERS: "", ANNOTATION_RESTARTS: str(group.restarts)})
    group.state = "Restarting"
    return True


def _replace_stragglers(plan: Plan, group: Group, sts_revision: str | None, ctx: _Context) -> bool:
    """Pods made from the previous template after the update (the StatefulSet controller had not
    seen it yet) are replaced too: the group must run one revision. True when it did."""
    if sts_revision != ctx.target or group.updated or not group.pods:
        return False
    _replace_pods(plan, group, {ANNOTATION_MEMBERS: ""})
    group.state = "Updating"
    return True


def _record_members(plan: Plan, group: Group, ctx: _Context) -> None:
    """Once a current group is complete, its pod UIDs are recorded: a mismatch later is a loss."""
    assert group.statefulset is not None
    if recorded_members(group.statefulset) or len(group.pods) != ctx.spec.pods_per_group:
        return
    uids = ",".join(sorted(p["metadata"]["uid"] for p in group.pods))
    plan.annotate.append((name_of(group.statefulset), {ANNOTATION_MEMBERS: uids}))


def _reconcile_group(plan: Plan, group: Group, ctx: _Context, events: Sequence[Mapping[str, Any]]) -> None:
    """Create a missing group, restart a broken one, keep a current one applied; mark an
    outdated one for the rolling update."""
    owner, spec = ctx.owner, ctx.spec
    service = builders.group_service(owner, spec, group.index)
    _apply_if_changed(plan, service, ctx.services.get(name_of(service)))
    if ctx.config.network_policy:
        policy = builders.group_policy(owner, spec, group.index)
        _apply_if_changed(plan, policy, ctx.policies.get(name_of(policy)))
    if group.statefulset is None:
        plan.apply.append(builders.group_statefulset(owner, spec, group.index, ctx.config))
        group.state = "Creating"
        return
    _group_view(group, spec, ctx.target)
    if _restart_if_member_lost(plan, group):
        return
    sts_revision = labels_of(group.statefulset).get(LABEL_REVISION)
    if _replace_stragglers(plan, group, sts_revision, ctx):
        return
    group.problem = group_problem(group, spec, events)
    if sts_revision != ctx.target:
        group.state = "Outdated"
        return
    desired = builders.group_statefulset(owner, spec, group.index, ctx.config)
    if _needs_apply(desired, group.statefulset) or group.statefulset["spec"]["replicas"] != spec.pods_per_group:
        plan.apply.append(desired)  # same revision: pods are not touched
    _record_members(plan, group, ctx)


def _roll_outdated(plan: Plan, groups: list[Group], ctx: _Context) -> None:
    """Outdated groups that are down anyway go now; an available one only when every other
    group is available, so at most one group is out of service for the update."""
    budget = 1 if all(g.ready for g in groups) else 0
    for group in (g for g in groups if g.state == "Outdated"):
        if group.ready:
            if budget == 0:
                continue
            budget -= 1
        plan.apply.append(builders.group_statefulset(ctx.owner, ctx.spec, group.index, ctx.config))
        _replace_pods(plan, group, {ANNOTATION_MEMBERS: ""})
        group.state = "Updating"
        group.problem = None
        plan.group_updates += 1
        plan.events.append(
            ("Normal", "GroupUpdate", f"replacing group {group.index} with revision {ctx.target}")
        )


def _status(ctx: _Context, groups: list[Group], now: str) -> dict[str, Any]:
    owner, spec = ctx.owner, ctx.spec
    generation = owner["metadata"].get("generation", 0)
    old = owner.get("status") or {}
    conditions = status_conditions(spec, groups, len(ctx.statefulsets), generation)
    return {
        "observedGeneration": generation,
        "replicas": len(ctx.statefulsets),
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
                **({"message": g.problem[1]} if g.problem else {}),
            }
            for g in groups
        ],
    }


def plan_reconcile(owner: Mapping[str, Any], observed: Observed, config: OperatorConfig, now: str) -> Plan:
    """Everything one reconcile of `owner` (an LLMService object) should do."""
    meta = owner["metadata"]
    try:
        spec = parse_spec(meta["name"], owner.get("spec") or {}, default_image=config.engine_image)
    except SpecError as error:
        return _invalid_spec_plan(owner, error, now)
    ctx = _Context(
        owner=owner,
        spec=spec,
        config=config,
        target=builders.revision(spec, meta["namespace"], config),
        services={name_of(s): s for s in observed.services},
        policies={name_of(p): p for p in observed.networkpolicies},
        statefulsets={i: objs[0] for i, objs in _by_group(observed.statefulsets).items()},
    )
    plan = Plan()
    _apply_service_objects(plan, ctx, observed)
    _delete_unwanted(plan, ctx)
    pods = _by_group([p for p in observed.pods if not is_terminating(p)])
    groups = [
        Group(i, ctx.statefulsets.get(i), sorted(pods.get(i, []), key=name_of)) for i in range(spec.replicas)
    ]
    for group in groups:
        _reconcile_group(plan, group, ctx, observed.events)
    _roll_outdated(plan, groups, ctx)
    plan.status = _status(ctx, groups, now)
    return plan
