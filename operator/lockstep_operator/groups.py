"""Engine groups as observed: their pods, and the facts the plan decides on. Pure.

Whether a pod is ready or restarted, whether a group lost a member, and why its pods are not
created, scheduled or started, all read from what the API server reports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lockstep_operator.constants import ANNOTATION_MEMBERS, LABEL_GROUP
from lockstep_operator.spec import ServiceSpec


@dataclass
class Group:
    index: int
    statefulset: Mapping[str, Any] | None
    pods: list[Mapping[str, Any]]  # live (not terminating) pods
    state: str = ""
    ready: bool = False
    updated: bool = False
    restarts: int = 0
    # Why the group's pods are not created, scheduled or started: (reason, message), or None.
    problem: tuple[str, str] | None = None
    # Restarts since the group was last ready (the crash-loop back-off counts these).
    failed_restarts: int = 0
    # An extra group of a rolling update (index >= spec.replicas), removed once it is done.
    surge: bool = False


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def annotations_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def name_of(obj: Mapping[str, Any]) -> str:
    return obj["metadata"]["name"]


def group_index(obj: Mapping[str, Any]) -> int | None:
    value = labels_of(obj).get(LABEL_GROUP, "")
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


# Lines the launcher adds after a rank's own error: they say which rank exited, not why.
_LAUNCHER_NOTE = re.compile(r"^launch\.py: rank process \d+ exited")
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b|\berror\b", re.IGNORECASE)
MAX_ERROR_CHARS = 300


def error_line(text: str) -> str:
    """The line of a termination message (the log's tail) that says why: the last exception or error
    line, else the last line. Where the launcher noted a rank's exit, only what came before the note
    counts: after it, the pod's other ranks print how they were stopped (a leader stopped while it
    loads says "draining"), not why the first one exited."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    noted = next((i for i, line in enumerate(lines) if _LAUNCHER_NOTE.match(line)), None)
    if noted is not None:
        lines = lines[:noted] or [line for line in lines if not _LAUNCHER_NOTE.match(line)]
    if not lines:
        return ""
    line = next((line for line in reversed(lines) if _ERROR_LINE.search(line)), lines[-1])
    return line[:MAX_ERROR_CHARS]


def termination(pod: Mapping[str, Any]) -> str | None:
    """How a container of the pod last ended with an error: exit code and the engine's last error line."""
    status = pod.get("status") or {}
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        for state in (container.get("state") or {}, container.get("lastState") or {}):
            ended = state.get("terminated") or {}
            if ended and int(ended.get("exitCode") or 0) != 0:
                line = error_line(str(ended.get("message") or ""))
                what = f"pod {name_of(pod)} container {container.get('name')} exited with code {ended.get('exitCode')}"
                if ended.get("reason") and ended["reason"] != "Error":
                    what += f" ({ended['reason']})"
                return f"{what}: {line}" if line else what
    return None


def recorded_members(statefulset: Mapping[str, Any]) -> set[str]:
    value = annotations_of(statefulset).get(ANNOTATION_MEMBERS, "")
    return {uid for uid in value.split(",") if uid}


def lost_member(group: Group) -> str | None:
    """Why the group can no longer run as one, or None."""
    for pod in group.pods:
        if (pod.get("status") or {}).get("phase") == "Failed":
            return f"pod {name_of(pod)} failed"
        if pod_restart_count(pod) > 0:
            return f"pod {name_of(pod)} restarted"
    members = recorded_members(group.statefulset or {})
    if not members:
        return None
    replaced = [name_of(p) for p in group.pods if p["metadata"]["uid"] not in members]
    if replaced:
        return f"pod {replaced[0]} was replaced"
    lost = len(members - {pod["metadata"]["uid"] for pod in group.pods})
    if lost:
        return f"{lost} of its pods {'was' if lost == 1 else 'were'} deleted"
    return None


# --- why pods do not run -----------------------------------------------------------------------

# Container waiting reasons that do not clear by themselves (a typo, a missing Secret, a registry).
STUCK_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


def pod_problem(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why a pod that exists does not run: the scheduler's verdict or a stuck container."""
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = condition.get("reason") or "Unschedulable"
            return reason, f"pod {name_of(pod)}: {condition.get('message') or reason}"
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in STUCK_WAITING_REASONS:
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            return reason, f"pod {name_of(pod)} container {container.get('name')}: {reason}{detail}"
    return None


def _event_time(event: Mapping[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp") or "")


def creation_problem(
    statefulset: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
) -> tuple[str, str] | None:
    """The latest FailedCreate of this StatefulSet (quota, Pod Security, a missing RuntimeClass...)."""
    uid = statefulset["metadata"].get("uid")
    mine = [e for e in events if (e.get("involvedObject") or {}).get("uid") == uid]
    if not mine:
        return None
    latest = max(mine, key=_event_time)
    return "FailedCreate", str(latest.get("message") or "the StatefulSet controller could not create a pod")


def group_problem(
    group: Group, spec: ServiceSpec, events: Sequence[Mapping[str, Any]]
) -> tuple[str, str] | None:
    if group.ready or group.statefulset is None:
        return None
    if len(group.pods) < spec.pods_per_group:
        found = creation_problem(group.statefulset, events)
        if found is not None:
            return found
    for pod in group.pods:
        found = pod_problem(pod)
        if found is not None:
            return found
    return None
