"""Names shared by the CRD, the builders and the handlers."""

from __future__ import annotations

GROUP = "serving.lockstep.dev"
VERSION = "v1alpha1"
PLURAL = "llmservices"
KIND = "LLMService"
API_VERSION = f"{GROUP}/{VERSION}"

# Annotation/label prefix for everything the operator (and kopf, for it) writes.
PREFIX = GROUP
FIELD_MANAGER = "lockstep-operator"
# Writes spec.replicas (scale subresource) for LLMServices with spec.autoscaling, and nothing else.
AUTOSCALER_FIELD_MANAGER = "lockstep-autoscaler"

LABEL_SERVICE = f"{PREFIX}/service"
LABEL_GROUP = f"{PREFIX}/group"
LABEL_REVISION = f"{PREFIX}/revision"
# Set on every pod by the StatefulSet controller (PodIndexLabel, on by default since 1.28).
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "lockstep-operator"
# Pods with this label (the chart's gateway) may reach engine HTTP through the NetworkPolicy.
LABEL_ENGINE_CLIENT = f"{PREFIX}/engine-client"

ANNOTATION_APPLIED = f"{PREFIX}/applied-hash"
# metadata.generation of a StatefulSet right after the operator applied it: a later generation
# means someone else changed its spec, and the operator applies it again.
ANNOTATION_APPLIED_GENERATION = f"{PREFIX}/applied-generation"
ANNOTATION_MEMBERS = f"{PREFIX}/members"
ANNOTATION_RESTARTS = f"{PREFIX}/restarts"
# Crash-loop back-off of a group: restarts since it was last ready, when the last one happened,
# and the engine's last error line (from the container's termination message).
ANNOTATION_FAILED_RESTARTS = f"{PREFIX}/failed-restarts"
ANNOTATION_LAST_RESTART = f"{PREFIX}/last-restart"
ANNOTATION_LAST_ERROR = f"{PREFIX}/last-error"
ANNOTATION_SERVED_MODEL = f"{PREFIX}/served-model-name"
# On the StatefulSet of an extra group a rolling update started (spec.rollout.maxSurge).
ANNOTATION_SURGE = f"{PREFIX}/surge"

ENGINE_PORT = 8000
RENDEZVOUS_PORT = 29500
DEFAULT_ENGINE_IMAGE = "ghcr.io/lockstep-dev/lockstep:0.1.0"
DEFAULT_NUM_SCHEDULER_STEPS = 8
LAUNCHER_DIR = "/etc/lockstep"
MODELS_DIR = "/models"
# Fetched models (init container) live here: an emptyDir, or spec.model.cache.claimName.
FETCHED_MODELS_DIR = f"{MODELS_DIR}/fetched"
# The one writable place besides /tmp and /dev/shm (the root filesystem is read-only): HOME and
# every cache (Lockstep's, Hugging Face, Triton, TorchInductor) point inside it.
CACHE_DIR = "/var/cache/lockstep"
# The engine's /tmp (an emptyDir): a bound, so a runaway writer gets its pod evicted, not the node's disk filled.
TMP_SIZE_LIMIT = "1Gi"
GROUP_SECRET_DIR = "/var/run/lockstep/group"
GROUP_SECRET_KEY = "secret"
MODEL_TOKEN_DIR = "/var/run/lockstep/model-token"
# Engine pods run as this user and group; the engine image must work as it (files world-readable).
ENGINE_UID = 65532
