"""Names, labels, selectors and the metadata every object the operator builds carries. Pure functions.

Selectors hold only labels the operator owns: they are immutable, so user labels never enter them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from lockstep_operator.constants import (
    ANNOTATION_APPLIED,
    API_VERSION,
    KIND,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    LABEL_POD_INDEX,
    LABEL_SERVICE,
    MANAGED_BY,
)


def digest(obj: Any, length: int = 10) -> str:
    """A short, stable hash of a JSON-able object."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def group_name(name: str, index: int) -> str:
    return f"{name}-g{index}"


def volume_name(prefix: str, key: str) -> str:
    """A pod volume name (a DNS label) for a key that may be longer or not a label itself."""
    return f"{prefix}-{digest(key, 10)}"


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


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Record the hash of the desired object so an unchanged one is not sent again."""
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED] = digest(obj)
    return obj


def object_metadata(owner: Mapping[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }
