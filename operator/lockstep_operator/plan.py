"""Observed objects -> what to change and what status to report. Pure: no API calls, no clock.

Rules (docs/KUBERNETES.md, "Reconcile behaviour"):
* groups missing below `spec.replicas` are created at the current revision, groups at or above it
  are deleted: scaling never touches the pods of the other groups;
* a group whose pods run an older revision is replaced as a whole (a rolling update): first up to
  `spec.rollout.maxSurge` extra groups are started at the new revision, and a ready old group is
  replaced only while at least `replicas - maxUnavailable` other groups are ready (a group that is
  not available anyway is replaced at once); the extra groups go once every group is updated and
  ready, so by default no capacity is lost;
* a group in which any pod restarted, failed, or was deleted or replaced is restarted as a whole:
  a TP/PP group cannot survive a lost rank. The pod UIDs of a complete group are recorded on its
  StatefulSet; a mismatch later means a member was lost. A group that fails again before it was
  ready waits out an exponential back-off before its next restart, and its status carries the
  engine's last error line (the container's termination message);
* status is recomputed from what exists every time; `spec` is never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from lockstep_operator import builders
from lockstep_operator.conditions import invalid_spec_status, merge_conditions, status_conditions
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_APPLIED,
    ANNOTATION_APPLIED_GENERATION,
    ANNOTATION_FAILED_RESTARTS,
    ANNOTATION_LAST_ERROR,
    ANNOTATION_LAST_RESTART,
    ANNOTATION_MEMBERS,
    ANNOTATION_RESTARTS,
    ANNOTATION_SURGE,
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
    termination,
)
from lockstep_operator.names import group_name, leader_selector_string
from lockstep_operator.pods import group_statefulset, revision
from lockstep_operator.spec import ServiceSpec, SpecError, parse_spec


@dataclass(frozen=True)
class Observed:
    """The LLMService's children as listed from the API server (only those it owns)."""

    statefulsets: Sequence[Mapping[str, Any]] = ()
    services: Sequence[Mapping[str, Any]] = ()
    configmaps: Sequence[Mapping[str, Any]] = ()
    networkpolicies: Sequence[Mapping[str, Any]] = ()
    disruptionbudgets: Sequence[Mapping[str, Any]] = ()
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
    # Reconcile again after this many seconds (a group's crash-loop back-off ends), or None.
    requeue_after: float | None = None

    def requeue(self, seconds: float) -> None:
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


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
    group.failed_restarts = int(annotations_of(group.statefulset or {}).get(ANNOTATION_FAILED_RESTARTS, "0") or 0)
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
    budgets = {name_of(b): b for b in observed.disruptionbudgets}
    pools = {"ConfigMap": configmaps, "Service": ctx.services, "NetworkPolicy": ctx.policies, "PodDisruptionBudget": budgets}
    for obj in builders.service_objects(ctx.owner, ctx.spec, ctx.config):
        _apply_if_changed(plan, obj, pools[obj["kind"]].get(name_of(obj)))
    if ctx.spec.max_disrupted is None:
        plan.delete += [("PodDisruptionBudget", name) for name in budgets]


def _delete_unwanted(plan: Plan, ctx: _Context, keep: int) -> None:
    """Scale down: whole groups from index `keep` on (spec.replicas plus the surge groups of a
    rollout) go, highest first (their pods go with them, by garbage collection), with their
    Services and NetworkPolicies; and every NetworkPolicy once policies are turned off."""
    for index in sorted(ctx.statefulsets, reverse=True):
        if index >= keep:
            sts = ctx.statefulsets[index]
            plan.delete.append(("StatefulSet", name_of(sts)))
            why = "the rolling update is done" if _is_surge(sts) else f"spec.replicas is {ctx.spec.replicas}"
            plan.events.append(("Normal", "GroupDelete", f"removing group {index}: {why}"))
    for name, svc in ctx.services.items():
        index = group_index(svc)
        if index is not None and index >= keep:
            plan.delete.append(("Service", name))
    for name, policy in ctx.policies.items():
        index = group_index(policy)
        if not ctx.config.network_policy or (index is not None and index >= keep):
            plan.delete.append(("NetworkPolicy", name))


def _is_surge(statefulset: Mapping[str, Any] | None) -> bool:
    return annotations_of(statefulset or {}).get(ANNOTATION_SURGE) == "true"


def _surge_groups_wanted(slots: list[Group], ctx: _Context) -> int:
    """How many extra groups the rollout needs now: up to maxSurge while old groups remain; the
    surge groups already there until every group is updated and ready; else none."""
    outdated = sum(g.state == "Outdated" for g in slots)
    if outdated:
        return min(ctx.spec.max_surge, outdated)
    if all(g.ready and g.updated for g in slots):
        return 0
    count = 0
    while count < ctx.spec.max_surge and _is_surge(ctx.statefulsets.get(ctx.spec.replicas + count)):
        count += 1
    return count


def parse_time(stamp: str) -> datetime:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def restart_backoff(failed_restarts: int, config: OperatorConfig) -> float:
    """Seconds that must pass after a group's previous restart before the next, when it has not been
    ready since: none after a ready spell, then the base delay doubling up to the maximum."""
    if failed_restarts <= 0:
        return 0.0
    return min(config.restart_backoff_seconds * 2 ** (failed_restarts - 1), config.restart_backoff_max_seconds)


def _last_error(group: Group) -> str:
    found = next((t for p in group.pods if (t := termination(p)) is not None), None)
    return found or annotations_of(group.statefulset or {}).get(ANNOTATION_LAST_ERROR, "")


def _crash_problem(group: Group, error: str, wait: float = 0.0) -> tuple[str, str] | None:
    """Why a group that failed since it was last ready is not serving: the engine's last error, and
    while it waits out its back-off (`wait` seconds) how often it was restarted."""
    if group.ready or group.failed_restarts == 0:
        return None
    if wait <= 0 and group.failed_restarts == 1:
        return ("EngineFailed", f"last error: {error}") if error else None
    times = "once" if group.failed_restarts == 1 else f"{group.failed_restarts} times"
    message = f"restarted {times} without becoming ready"
    message += f"; last error: {error}" if error else ""
    message += f"; next restart in {wait:.0f} s" if wait > 0 else ""
    return "CrashLoopBackOff", message


def _restart_if_member_lost(plan: Plan, group: Group, ctx: _Context, now: str) -> bool:
    """A TP/PP group cannot survive a lost rank: replace every pod, or wait out the crash-loop
    back-off first. True when it did either."""
    reason = lost_member(group)
    if reason is None:
        return False
    error = _last_error(group)
    annotations = annotations_of(group.statefulset or {})
    last = annotations.get(ANNOTATION_LAST_RESTART)
    if last and group.failed_restarts > 0:
        elapsed = (parse_time(now) - parse_time(last)).total_seconds()
        wait = restart_backoff(group.failed_restarts, ctx.config) - elapsed
        if wait > 0:
            group.state = "CrashLoopBackOff"
            group.problem = _crash_problem(group, error, wait)
            if error and error != annotations.get(ANNOTATION_LAST_ERROR):
                plan.annotate.append((name_of(group.statefulset), {ANNOTATION_LAST_ERROR: error}))
            plan.requeue(wait)
            return True
    group.restarts += 1
    group.failed_restarts += 1
    message = f"restarting group {group.index}: {reason}"
    if error:
        message += f"; last error: {error}"
    next_wait = restart_backoff(group.failed_restarts, ctx.config)
    if group.failed_restarts > 1:
        message += f"; restart {group.failed_restarts} without becoming ready, the next one waits {next_wait:.0f} s"
    plan.events.append(("Warning", "GroupRestart", message))
    plan.group_restarts += 1
    marks = {
        ANNOTATION_MEMBERS: "",
        ANNOTATION_RESTARTS: str(group.restarts),
        ANNOTATION_FAILED_RESTARTS: str(group.failed_restarts),
        ANNOTATION_LAST_RESTART: now,
    }
    if error:
        marks[ANNOTATION_LAST_ERROR] = error
    _replace_pods(plan, group, marks)
    group.state = "Restarting"
    group.problem = _crash_problem(group, error)
    return True


def _forget_failures_once_ready(plan: Plan, group: Group) -> None:
    """A group that became ready again starts its next crash loop with a restart at once."""
    if group.ready and group.failed_restarts:
        assert group.statefulset is not None
        plan.annotate.append((name_of(group.statefulset), {ANNOTATION_FAILED_RESTARTS: "0", ANNOTATION_LAST_ERROR: ""}))
        group.failed_restarts = 0


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


def _reconcile_group(
    plan: Plan, group: Group, ctx: _Context, events: Sequence[Mapping[str, Any]], now: str
) -> None:
    """Create a missing group, restart a broken one, keep a current one applied; mark an
    outdated one for the rolling update."""
    owner, spec = ctx.owner, ctx.spec
    service = builders.group_service(owner, spec, group.index)
    _apply_if_changed(plan, service, ctx.services.get(name_of(service)))
    if ctx.config.network_policy:
        policy = builders.group_policy(owner, spec, group.index)
        _apply_if_changed(plan, policy, ctx.policies.get(name_of(policy)))
    if group.statefulset is None:
        plan.apply.append(group_statefulset(owner, spec, group.index, ctx.config, group.surge))
        group.state = "Creating"
        what = "an extra group of the rolling update" if group.surge else f"spec.replicas is {spec.replicas}"
        plan.events.append(("Normal", "GroupCreate", f"creating group {group.index} ({spec.pods_per_group} "
                            f"pod{'s' if spec.pods_per_group > 1 else ''}, revision {ctx.target}): {what}"))  # fmt: skip
        return
    _group_view(group, spec, ctx.target)
    if _restart_if_member_lost(plan, group, ctx, now):
        return
    _forget_failures_once_ready(plan, group)
    sts_revision = labels_of(group.statefulset).get(LABEL_REVISION)
    if _replace_stragglers(plan, group, sts_revision, ctx):
        return
    group.problem = group_problem(group, spec, events) or _crash_problem(group, _last_error(group))
    if sts_revision != ctx.target:
        group.state = "Outdated"
        return
    desired = group_statefulset(owner, spec, group.index, ctx.config, group.surge)
    if _needs_apply(desired, group.statefulset) or group.statefulset["spec"]["replicas"] != spec.pods_per_group:
        plan.apply.append(desired)  # same revision: pods are not touched
    _record_members(plan, group, ctx)


def _roll_outdated(plan: Plan, groups: list[Group], ctx: _Context) -> None:
    """Outdated groups that are down anyway go now; a ready one only while at least
    `replicas - maxUnavailable` other groups (surge groups included) stay ready."""
    budget = sum(g.ready for g in groups) - (ctx.spec.replicas - ctx.spec.max_unavailable)
    for group in (g for g in groups if g.state == "Outdated"):
        if group.ready:
            if budget <= 0:
                continue
            budget -= 1
        plan.apply.append(group_statefulset(ctx.owner, ctx.spec, group.index, ctx.config, group.surge))
        _replace_pods(plan, group, {ANNOTATION_MEMBERS: ""})
        group.state = "Updating"
        group.problem = None
        plan.group_updates += 1
        plan.events.append(
            ("Normal", "GroupUpdate", f"replacing group {group.index} with revision {ctx.target}")
        )


def _status(ctx: _Context, slots: list[Group], surges: list[Group], now: str) -> dict[str, Any]:
    owner, spec = ctx.owner, ctx.spec
    generation = owner["metadata"].get("generation", 0)
    old = owner.get("status") or {}
    groups = slots + surges
    # Surge groups (kept, or being removed after a rollout) are the rollout's, not scaling.
    existing = sum(1 for i, sts in ctx.statefulsets.items() if i < spec.replicas or not _is_surge(sts))
    conditions = status_conditions(spec, slots, existing, generation, surge=sum(_is_surge(s) for s in ctx.statefulsets.values()))
    return {
        "observedGeneration": generation,
        "replicas": len(ctx.statefulsets),
        "readyReplicas": sum(g.ready for g in groups),
        "updatedReplicas": sum(g.updated for g in groups),
        "selector": leader_selector_string(spec.name),
        "podsPerGroup": spec.pods_per_group,
        "steps": spec.steps,
        "conditions": merge_conditions(conditions, old.get("conditions", []), now),
        "groups": [
            {
                "index": g.index,
                "leader": f"{group_name(spec.name, g.index)}-0",
                "state": g.state,
                "ready": g.ready,
                "readyPods": sum(is_pod_ready(p) for p in g.pods),
                "updated": g.updated,
                "restarts": g.restarts,
                **({"surge": True} if g.surge else {}),
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
        target=revision(spec, meta["namespace"], config),
        services={name_of(s): s for s in observed.services},
        policies={name_of(p): p for p in observed.networkpolicies},
        statefulsets={i: objs[0] for i, objs in _by_group(observed.statefulsets).items()},
    )
    plan = Plan()
    _apply_service_objects(plan, ctx, observed)
    pods = _by_group([p for p in observed.pods if not is_terminating(p)])

    def group(index: int, surge: bool = False) -> Group:
        return Group(index, ctx.statefulsets.get(index), sorted(pods.get(index, []), key=name_of), surge=surge)

    slots = [group(i) for i in range(spec.replicas)]
    for slot in slots:
        _reconcile_group(plan, slot, ctx, observed.events, now)
    surges = [group(spec.replicas + k, surge=True) for k in range(_surge_groups_wanted(slots, ctx))]
    for surge in surges:
        _reconcile_group(plan, surge, ctx, observed.events, now)
    _delete_unwanted(plan, ctx, keep=spec.replicas + len(surges))
    _roll_outdated(plan, slots + surges, ctx)
    plan.status = _status(ctx, slots, surges, now)
    return plan
