"""LLMService status conditions (Ready, Available, Progressing, Degraded), from the groups. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lockstep_operator.groups import Group
from lockstep_operator.spec import ServiceSpec, SpecError


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
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


def status_conditions(
    spec: ServiceSpec, groups: list[Group], existing: int, generation: int, surge: int = 0
) -> list[dict[str, Any]]:
    """Conditions from the groups 0..replicas-1; `surge` counts the extra groups of a rollout."""
    desired = spec.replicas
    ready = sum(g.ready for g in groups)
    updated = sum(g.updated for g in groups)
    restarting = [g for g in groups if g.state == "Restarting"]
    counts = f"{ready} of {desired} groups ready, {updated} updated"
    if desired == 0:
        ready_c = condition("Ready", existing == 0, "ScaledToZero", "spec.replicas is 0", generation)
        available = condition("Available", False, "ScaledToZero", "spec.replicas is 0", generation)
    else:
        all_ready = ready == desired and updated == desired and existing == desired
        ready_c = condition(
            "Ready", all_ready, "AllGroupsReady" if all_ready else "GroupsNotReady", counts, generation
        )
        available = condition(
            "Available", ready > 0, "GroupsAvailable" if ready else "NoGroupReady", counts, generation
        )
    if existing != desired:
        progressing = condition(
            "Progressing", True, "Scaling", f"{existing} groups, scaling to {desired}", generation
        )
    elif updated < desired:
        progressing = condition(
            "Progressing", True, "RollingUpdate", f"{updated} of {desired} groups updated", generation
        )
    elif ready < desired:
        progressing = condition("Progressing", True, "GroupsStarting", counts, generation)
    elif surge:
        progressing = condition(
            "Progressing", True, "RollingUpdate", f"{counts}; removing {surge} surge group(s)", generation
        )
    else:
        progressing = condition("Progressing", False, "Complete", counts, generation)
    problems = [(g.index, problem) for g in groups if (problem := g.problem) is not None]
    if problems:
        # Why pods do not run is the first thing a user needs: it becomes Ready's reason too.
        reason = problems[0][1][0]
        message = "; ".join(f"group {index}: {text}" for index, (_, text) in problems)
        degraded = condition("Degraded", True, reason, message, generation)
        if ready_c["status"] != "True":
            ready_c = condition("Ready", False, reason, f"{counts}; {message}", generation)
    elif restarting:
        message = "; ".join(f"group {g.index} restarting" for g in restarting)
        degraded = condition("Degraded", True, "GroupRestarting", message, generation)
    else:
        degraded = condition("Degraded", False, "AsExpected", "", generation)
    return [ready_c, available, progressing, degraded]


def invalid_spec_status(owner: Mapping[str, Any], error: SpecError, now: str) -> dict[str, Any]:
    generation = owner["metadata"].get("generation", 0)
    old = owner.get("status") or {}
    message = str(error)
    conditions = [
        condition("Ready", False, "InvalidSpec", message, generation),
        condition(
            "Available",
            bool(old.get("readyReplicas")),
            "InvalidSpec",
            "existing groups are left as they are until the spec is fixed",
            generation,
        ),
        condition("Progressing", False, "InvalidSpec", message, generation),
        condition("Degraded", True, "InvalidSpec", message, generation),
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
    conditions.append(condition("Degraded", True, "ReconcileError", message, generation))
    return {**old, "conditions": merge_conditions(conditions, old.get("conditions", []), now)}


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether `new` says anything `old` does not (transition times aside)."""

    def strip(status: Mapping[str, Any] | None) -> dict[str, Any]:
        status = dict(status or {})
        status["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
        ]
        return status

    return strip(old) != strip(new)
