"""LLMService spec -> ServiceSpec: defaults applied, every rule of the CRD checked again.

The API server enforces the same rules through the CRD schema and its CEL validations; checking
them here too means an object stored under an older CRD, or a rule the cluster could not enforce,
surfaces as `Ready=False, reason=InvalidSpec` with a message naming the field, never as a field
silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep_operator.autoscale import Autoscaling
from lockstep_operator.constants import DEFAULT_NUM_SCHEDULER_STEPS
from lockstep_operator.errors import SpecError
from lockstep_operator.lora import LORA_FLAGS, LoraConfig, check_lora
from lockstep_operator.sources import check_form, is_fetched, pvc_claim

# Flags the operator derives from spec fields; repeating them in extraArgs would be ambiguous.
OWNED_FLAGS = (
    "--port",
    "--host",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--num-scheduler-steps",
    "--max-num-seqs",
    "--max-model-len",
    "--served-model-name",
    "--speculative-config",
    *LORA_FLAGS,
)
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENDPOINT_RE = re.compile(r"^https?://[^/\s]+(/\S*)?$")
_SECRET_NAME_RE = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
MAX_NAME_LENGTH = 40
MAX_RANKS_PER_GROUP = 256
# A Kubernetes resource.Quantity as the API server parses it: a decimal number and an optional suffix.
_QUANTITY_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")
_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip
# Engine containers that set no spec.engine.resources get these requests (no limits): a pod without
# requests is BestEffort, the first one evicted or OOM-killed under node pressure.
DEFAULT_ENGINE_REQUESTS = {"cpu": "1", "memory": "4Gi"}
DEFAULT_TERMINATION_GRACE_SECONDS = 60


@dataclass(frozen=True)
class SecretKey:
    """One key of a Secret in the LLMService's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    source: str
    served_name: str
    num_scheduler_steps: int | None  # None when adaptive
    tensor: int
    pipeline: int
    gpus_per_pod: int
    replicas: int
    image: str
    image_pull_policy: str | None
    max_num_seqs: int | None
    max_model_len: int | None
    extra_args: tuple[str, ...]
    shm_size: str | None
    resources: Mapping[str, Any]
    env: tuple[Mapping[str, Any], ...]
    template: Mapping[str, Any]
    startup_timeout_seconds: int
    ranks_per_pod: int = 1
    # Where an hf:// or URL source comes from and goes to (unused by other sources).
    model_endpoint: str | None = None
    model_token_secret: SecretKey | None = None
    model_cache_claim: str | None = None
    api_key_secret: SecretKey | None = None
    # Rolling updates, resolved against replicas: extra groups started at the new revision, and
    # groups that may be out of service, while groups are replaced.
    max_surge: int = 1
    max_unavailable: int = 0
    # spec.autoscaling: the operator sets spec.replicas (through the scale subresource) from demand.
    autoscaling: Autoscaling | None = None
    # How long an engine pod may take to stop (drain its requests) once asked to, e.g. by a node drain.
    termination_grace_seconds: int = DEFAULT_TERMINATION_GRACE_SECONDS
    # spec.disruptionBudget.maxUnavailable: engine pods a voluntary disruption (an eviction) may take at
    # once; every eviction stops one whole group, so at most this many groups; None: no budget.
    max_disrupted: int | None = 1

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def pods_per_group(self) -> int:
        return self.world_size // self.ranks_per_pod

    @property
    def steps(self) -> str:
        """The value of --num-scheduler-steps."""
        return "auto" if self.num_scheduler_steps is None else str(self.num_scheduler_steps)

    @property
    def pvc_claim(self) -> str | None:
        return pvc_claim(self.source)

    @property
    def fetched(self) -> bool:
        """Whether an init container fetches the model before the engine starts."""
        return is_fetched(self.source)
    # spec.speculativeConfig as the engine's --speculative-config JSON; None: no speculation.
    speculative_config: str | None = None
    # spec.lora and spec.loraAdapters; None: the engine serves no adapters.
    lora: LoraConfig | None = None



def _int(
    raw: Mapping[str, Any], key: str, field: str, default: int | None, low: int, high: int
) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"must be an integer in {low}..{high}, got {value!r}")
    if not low <= value <= high:
        raise SpecError(field, f"must be in {low}..{high}, got {value}")
    return value


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError(f"spec.{key}", f"must be an object, got {type(value).__name__}")
    return value


def _check_name(name: str) -> None:
    if len(name) > MAX_NAME_LENGTH or not _NAME_RE.match(name):
        raise SpecError(
            "metadata.name",
            f"must be a DNS label of at most {MAX_NAME_LENGTH} characters starting with a letter, got {name!r}",
        )


def _check_source(source: Any) -> str:
    if not isinstance(source, str) or not source:
        raise SpecError(
            "spec.model.source",
            "is required (smollm2, random:<shape>, /path, pvc://claim/path, hf://org/repo[@revision] "
            f"or an http(s):// URL), got {source!r}",
        )
    check_form(source, "spec.model.source")
    return source


def _check_secret_key(raw: Any, field: str, default_key: str) -> SecretKey | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not _SECRET_NAME_RE.match(str(raw.get("name") or "")):
        raise SpecError(field, f"must be {{name: <Secret name>, key: <key>}} naming a Secret, got {raw!r}")
    return SecretKey(name=raw["name"], key=str(raw.get("key") or default_key))


def _check_ranks_per_pod(parallelism: Mapping[str, Any], gpus_per_pod: int) -> int:
    ranks = _int(parallelism, "ranksPerPod", "spec.parallelism.ranksPerPod", None, 1, 16)
    if ranks is None:
        return max(gpus_per_pod, 1)
    if gpus_per_pod and ranks != gpus_per_pod:
        raise SpecError(
            "spec.parallelism.ranksPerPod",
            f"must equal gpusPerPod ({gpus_per_pod}) when the pod has GPUs (one rank per GPU), got {ranks}",
        )
    return ranks


def _check_extra_args(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        raise SpecError("spec.engine.extraArgs", f"must be a list of strings, got {raw!r}")
    for arg in raw:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise SpecError(
                "spec.engine.extraArgs",
                f"must not set {flag} (the operator sets {', '.join(OWNED_FLAGS)} from spec fields); use the matching spec field",
            )
    return tuple(raw)


def _check_env(raw: Any) -> tuple[Mapping[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("spec.engine.env", f"must be a list of EnvVar objects, got {raw!r}")
    for item in raw:
        name = item.get("name", "") if isinstance(item, Mapping) else ""
        if not name:
            raise SpecError("spec.engine.env", f"every item needs a name, got {item!r}")
        if name.startswith("LOCKSTEP_"):
            raise SpecError(
                "spec.engine.env",
                f"must not set {name}: LOCKSTEP_* variables belong to the engine pod contract",
            )
    return tuple(raw)


def quantity_value(value: Any) -> float | None:
    """A resource quantity's value (2Gi -> 2147483648.0, 500m -> 0.5), or None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY_RE.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return float(number + suffix)
    sign = -1.0 if value.startswith("-") else 1.0
    return sign * float(number) * _SUFFIX[suffix]


def _check_quantity(value: Any, field: str) -> Any:
    amount = quantity_value(value)
    if amount is None or amount < 0:
        raise SpecError(field, f"must be a non-negative quantity such as 500m, 2 or 4Gi, got {value!r}")
    return value


def _check_resources(raw: Any) -> dict[str, Any]:
    """spec.engine.resources: every amount a quantity, no request above its limit; requests by default."""
    if raw is None or raw == {}:
        return {"requests": dict(DEFAULT_ENGINE_REQUESTS)}
    if not isinstance(raw, Mapping):
        raise SpecError("spec.engine.resources", f"must be an object with limits and requests, got {raw!r}")
    result: dict[str, Any] = {}
    for kind in ("limits", "requests"):
        amounts = raw.get(kind)
        if amounts is None:
            continue
        if not isinstance(amounts, Mapping):
            raise SpecError(f"spec.engine.resources.{kind}", f"must map resource names to quantities, got {amounts!r}")
        result[kind] = {name: _check_quantity(value, f"spec.engine.resources.{kind}.{name}") for name, value in amounts.items()}
    for name, request in (result.get("requests") or {}).items():
        limit = (result.get("limits") or {}).get(name)
        if limit is not None and quantity_value(request) > quantity_value(limit):  # type: ignore[operator]
            raise SpecError(f"spec.engine.resources.requests.{name}", f"({request}) must not exceed its limit ({limit})")
    return result


def _check_disruption_budget(raw: Mapping[str, Any]) -> int | None:
    if raw.get("enabled", True) is False:
        return None
    return _int(raw, "maxUnavailable", "spec.disruptionBudget.maxUnavailable", 1, 0, 1024)


_PERCENT_RE = re.compile(r"^(?P<value>\d{1,3})%$")


def _int_or_percent(raw: Mapping[str, Any], key: str, field: str, default: int, replicas: int, round_up: bool) -> int:
    """An IntOrString as Deployments take it: a count, or a percentage of replicas (surge rounds up,
    unavailability down)."""
    value = raw.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1024:
        return value
    match = _PERCENT_RE.match(value) if isinstance(value, str) else None
    if match is None or int(match.group("value")) > 100:
        raise SpecError(field, f"must be an integer in 0..1024 or a percentage such as '25%', got {value!r}")
    share = int(match.group("value")) * replicas
    return -(-share // 100) if round_up else share // 100


def _check_rollout(raw: Mapping[str, Any], replicas: int) -> tuple[int, int]:
    surge = _int_or_percent(raw, "maxSurge", "spec.rollout.maxSurge", 1, replicas, round_up=True)
    unavailable = _int_or_percent(raw, "maxUnavailable", "spec.rollout.maxUnavailable", 0, replicas, round_up=False)
    if raw.get("maxSurge", 1) in (0, "0%") and raw.get("maxUnavailable", 0) in (0, "0%"):
        raise SpecError("spec.rollout", "maxSurge and maxUnavailable cannot both be 0 (no group could be replaced)")
    if surge == 0 and unavailable == 0:
        unavailable = 1  # percentages that round to nothing: as a Deployment, one at a time
    return surge, unavailable


def _check_autoscaling(raw: Any) -> Autoscaling | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SpecError("spec.autoscaling", f"must be an object, got {type(raw).__name__}")
    low = _int(raw, "minReplicas", "spec.autoscaling.minReplicas", 1, 0, 1024)
    high = _int(raw, "maxReplicas", "spec.autoscaling.maxReplicas", None, 1, 1024)
    if high is None:
        raise SpecError("spec.autoscaling.maxReplicas", "is required (1..1024)")
    assert low is not None
    if low > high:
        raise SpecError("spec.autoscaling.minReplicas", f"must be at most maxReplicas ({high}), got {low}")
    target = _int(raw, "targetWaitingPerGroup", "spec.autoscaling.targetWaitingPerGroup", 2, 1, 65536)
    delay = _int(raw, "scaleDownDelaySeconds", "spec.autoscaling.scaleDownDelaySeconds", 300, 0, 86400)
    assert target is not None and delay is not None
    return Autoscaling(min_replicas=low, max_replicas=high, target_waiting_per_group=target, scale_down_delay_seconds=delay)


def parse_spec(name: str, raw: Mapping[str, Any], *, default_image: str) -> ServiceSpec:
    """Validate an LLMService's `spec` and fill in defaults; raises SpecError."""
    _check_name(name)
    model = _section(raw, "model")
    decode = _section(raw, "decode")
    parallelism = _section(raw, "parallelism")
    engine = _section(raw, "engine")
    startup = _section(raw, "startup")

    adaptive = bool(decode.get("adaptive", False))
    steps = _int(decode, "numSchedulerSteps", "spec.decode.numSchedulerSteps", None, 1, 64)
    if adaptive and steps is not None:
        raise SpecError(
            "spec.decode.numSchedulerSteps",
            "cannot be set together with decode.adaptive: true (adaptive chooses the step count)",
        )
    if not adaptive and steps is None:
        steps = DEFAULT_NUM_SCHEDULER_STEPS

    tensor = _int(parallelism, "tensor", "spec.parallelism.tensor", 1, 1, 64)
    pipeline = _int(parallelism, "pipeline", "spec.parallelism.pipeline", 1, 1, 64)
    gpus_per_pod = _int(parallelism, "gpusPerPod", "spec.parallelism.gpusPerPod", 1, 0, 16)
    assert tensor is not None and pipeline is not None and gpus_per_pod is not None
    world_size = tensor * pipeline
    if world_size % max(gpus_per_pod, 1):
        raise SpecError(
            "spec.parallelism.gpusPerPod",
            f"tensor * pipeline ({world_size}) must be divisible by gpusPerPod ({gpus_per_pod})",
        )
    ranks_per_pod = _check_ranks_per_pod(parallelism, gpus_per_pod)
    if world_size % ranks_per_pod:
        raise SpecError(
            "spec.parallelism.ranksPerPod",
            f"tensor * pipeline ({world_size}) must be divisible by ranksPerPod ({ranks_per_pod})",
        )
    if world_size > MAX_RANKS_PER_GROUP:
        raise SpecError(
            "spec.parallelism", f"tensor * pipeline ({world_size}) must be at most {MAX_RANKS_PER_GROUP}"
        )

    if raw.get("speculativeConfig") is not None and world_size > 1:
        raise SpecError("spec.speculativeConfig", f"needs tensor = pipeline = 1 (the engine speculates on one rank), "
                                                  f"got tensor * pipeline = {world_size}")
    replicas = _int(raw, "replicas", "spec.replicas", 1, 0, 1024)
    startup_timeout = _int(startup, "timeoutSeconds", "spec.startup.timeoutSeconds", 1800, 30, 86400)
    assert replicas is not None and startup_timeout is not None
    max_surge, max_unavailable = _check_rollout(_section(raw, "rollout"), replicas)
    shm_size = engine.get("shmSize")
    if shm_size is not None:
        _check_quantity(shm_size, "spec.engine.shmSize")
    grace = _int(engine, "terminationGracePeriodSeconds", "spec.engine.terminationGracePeriodSeconds",
                 DEFAULT_TERMINATION_GRACE_SECONDS, 10, 86400)  # fmt: skip
    assert grace is not None
    source = _check_source(model.get("source"))
    endpoint = model.get("endpoint")
    if endpoint is not None and not _ENDPOINT_RE.match(str(endpoint)):
        raise SpecError("spec.model.endpoint", f"must be an http(s):// URL of a Hugging Face hub mirror, got {endpoint!r}")
    cache = _section(model, "cache")
    cache_claim = cache.get("claimName")
    if cache_claim is not None and not _NAME_RE.match(str(cache_claim)):
        raise SpecError(
            "spec.model.cache.claimName", f"must name a PersistentVolumeClaim (a DNS label), got {cache_claim!r}"
        )
    return ServiceSpec(
        name=name,
        source=source,
        served_name=model.get("servedName") or name,
        num_scheduler_steps=steps,
        tensor=tensor,
        pipeline=pipeline,
        gpus_per_pod=gpus_per_pod,
        replicas=replicas,
        image=engine.get("image") or default_image,
        image_pull_policy=engine.get("imagePullPolicy"),
        max_num_seqs=_int(engine, "maxNumSeqs", "spec.engine.maxNumSeqs", None, 1, 65536),
        max_model_len=_int(engine, "maxModelLen", "spec.engine.maxModelLen", None, 16, 1048576),
        extra_args=_check_extra_args(engine.get("extraArgs")),
        shm_size=None if shm_size is None else str(shm_size),
        resources=_check_resources(engine.get("resources")),
        env=_check_env(engine.get("env")),
        template=dict(raw.get("template") or {}),
        startup_timeout_seconds=startup_timeout,
        ranks_per_pod=ranks_per_pod,
        model_endpoint=model.get("endpoint") or None,
        model_token_secret=_check_secret_key(model.get("tokenSecret"), "spec.model.tokenSecret", "token"),
        model_cache_claim=cache_claim,
        api_key_secret=_check_secret_key(engine.get("apiKeySecret"), "spec.engine.apiKeySecret", "api-key"),
        max_surge=max_surge,
        max_unavailable=max_unavailable,
        autoscaling=_check_autoscaling(raw.get("autoscaling")),
        termination_grace_seconds=grace,
        max_disrupted=_check_disruption_budget(_section(raw, "disruptionBudget")),
        speculative_config=_check_speculative(raw.get("speculativeConfig")),
        lora=check_lora(raw.get("lora"), raw.get("loraAdapters"), served_name=model.get("servedName") or name),
    )


_SPECULATIVE_KEYS = {"method": "method", "numSpeculativeTokens": "num_speculative_tokens",
                     "promptLookupMax": "prompt_lookup_max", "promptLookupMin": "prompt_lookup_min", "model": "model"}


def _check_speculative(raw: Any) -> str | None:
    """spec.speculativeConfig -> the engine's --speculative-config JSON (vLLM's keys), the CRD's rules again."""
    if raw is None:
        return None
    field = "spec.speculativeConfig"
    if not isinstance(raw, Mapping):
        raise SpecError(field, f"must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise SpecError(f"{field}.{unknown[0]}", f"is not a field; expected {', '.join(_SPECULATIVE_KEYS)}")
    method = raw.get("method")
    if method not in ("ngram", "draft_model"):
        raise SpecError(f"{field}.method", f"must be ngram or draft_model, got {method!r}")
    k = _int(raw, "numSpeculativeTokens", f"{field}.numSpeculativeTokens", None, 1, 16)
    if k is None:
        raise SpecError(f"{field}.numSpeculativeTokens", "is required (1..16)")
    high = _int(raw, "promptLookupMax", f"{field}.promptLookupMax", None, 1, 64)
    low = _int(raw, "promptLookupMin", f"{field}.promptLookupMin", None, 1, 64)
    model = raw.get("model")
    if method == "draft_model":
        if not isinstance(model, str) or not 1 <= len(model) <= 512:
            raise SpecError(f"{field}.model", f"is required with method draft_model (the draft's source), got {model!r}")
        if high is not None or low is not None:
            raise SpecError(f"{field}.promptLookupMax", "promptLookupMax and promptLookupMin are only for method ngram")
    elif model is not None:
        raise SpecError(f"{field}.model", "is only for method draft_model")
    if high is not None and low is not None and low > high:
        raise SpecError(f"{field}.promptLookupMin", f"must be at most promptLookupMax ({high}), got {low}")
    config = {_SPECULATIVE_KEYS[key]: value for key, value in raw.items()}
    return json.dumps(config, sort_keys=True, separators=(",", ":"))
