"""LLMService spec validation in the operator: defaults, and errors that name the field and the range."""

from __future__ import annotations

import pytest

from k8s_harness import crd_schema
from lockstep_operator.spec import OWNED_FLAGS, SpecError, parse_spec, quantity_value

IMAGE = "registry.example/lockstep:9.9.9"


def parse(spec: dict, name: str = "demo"):
    return parse_spec(name, spec, default_image=IMAGE)


def test_defaults_fill_a_minimal_spec():
    spec = parse({"model": {"source": "smollm2"}})
    assert (spec.tensor, spec.pipeline, spec.gpus_per_pod, spec.replicas) == (1, 1, 1, 1)
    assert spec.steps == "8"
    assert spec.served_name == "demo"
    assert spec.image == IMAGE
    assert spec.startup_timeout_seconds == 1800
    assert spec.pods_per_group == 1


def test_pods_per_group_is_ranks_over_gpus_per_pod():
    assert (
        parse(
            {"model": {"source": "x"}, "parallelism": {"tensor": 4, "pipeline": 2, "gpusPerPod": 2}}
        ).pods_per_group
        == 4
    )
    assert (
        parse(
            {"model": {"source": "x"}, "parallelism": {"tensor": 2, "pipeline": 2, "gpusPerPod": 0}}
        ).pods_per_group
        == 4
    )
    assert (
        parse(
            {"model": {"source": "x"}, "parallelism": {"tensor": 8, "pipeline": 1, "gpusPerPod": 8}}
        ).pods_per_group
        == 1
    )


def test_adaptive_decode_passes_auto():
    assert parse({"model": {"source": "x"}, "decode": {"adaptive": True}}).steps == "auto"


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({"decode": {"numSchedulerSteps": 0}}, "spec.decode.numSchedulerSteps", "1..64, got 0"),
        ({"decode": {"numSchedulerSteps": 65}}, "spec.decode.numSchedulerSteps", "1..64, got 65"),
        ({"decode": {"adaptive": True, "numSchedulerSteps": 4}}, "spec.decode.numSchedulerSteps", "adaptive"),
        (
            {"parallelism": {"tensor": 3, "gpusPerPod": 2}},
            "spec.parallelism.gpusPerPod",
            "tensor * pipeline (3) must be divisible by gpusPerPod (2)",
        ),
        ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor", "1..64, got 0"),
        ({"replicas": -1}, "spec.replicas", "0..1024, got -1"),
        ({"replicas": "2"}, "spec.replicas", "integer"),
        (
            {"engine": {"extraArgs": ["--num-scheduler-steps=4"]}},
            "spec.engine.extraArgs",
            "--num-scheduler-steps",
        ),
        ({"engine": {"env": [{"name": "LOCKSTEP_RANK", "value": "3"}]}}, "spec.engine.env", "LOCKSTEP_RANK"),
        ({"startup": {"timeoutSeconds": 5}}, "spec.startup.timeoutSeconds", "30..86400, got 5"),
        (
            {"parallelism": {"tensor": 4, "gpusPerPod": 4, "ranksPerPod": 2}},
            "spec.parallelism.ranksPerPod",
            "must equal gpusPerPod (4)",
        ),
        (
            {"parallelism": {"tensor": 3, "gpusPerPod": 0, "ranksPerPod": 2}},
            "spec.parallelism.ranksPerPod",
            "tensor * pipeline (3) must be divisible by ranksPerPod (2)",
        ),
        ({"model": {"source": "hf://just-a-name"}}, "spec.model.source", "hf://<org>/<repo>"),
        ({"model": {"source": "https://host-only"}}, "spec.model.source", "a URL with a host and a path"),
        ({"model": {"source": "hf://o/m", "endpoint": "ftp://x"}}, "spec.model.endpoint", "http(s)://"),
        ({"model": {"source": "hf://o/m", "tokenSecret": {"key": "t"}}}, "spec.model.tokenSecret", "naming a Secret"),
        ({"model": {"source": "hf://o/m", "cache": {"claimName": "Bad_Claim"}}}, "spec.model.cache.claimName", "DNS label"),
        ({"engine": {"apiKeySecret": "key"}}, "spec.engine.apiKeySecret", "naming a Secret"),
        ({"engine": {"shmSize": "lots"}}, "spec.engine.shmSize", "quantity such as 500m, 2 or 4Gi, got 'lots'"),
        ({"engine": {"resources": {"requests": {"cpu": "two"}}}}, "spec.engine.resources.requests.cpu", "got 'two'"),
        ({"engine": {"resources": {"limits": {"memory": "-1Gi"}}}}, "spec.engine.resources.limits.memory", "non-negative"),
        (
            {"engine": {"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}}},
            "spec.engine.resources.requests.memory",
            "(8Gi) must not exceed its limit (4Gi)",
        ),
        ({"engine": {"terminationGracePeriodSeconds": 5}}, "spec.engine.terminationGracePeriodSeconds", "10..86400"),
        ({"disruptionBudget": {"maxUnavailable": -1}}, "spec.disruptionBudget.maxUnavailable", "0..1024"),
    ],
)
def test_invalid_specs_name_field_and_allowed_values(spec, field, words):
    with pytest.raises(SpecError) as caught:
        parse({"model": {"source": "smollm2"}, **spec} if "model" not in spec else spec)
    assert caught.value.field == field
    assert words in str(caught.value)


def test_quantities_parse_as_the_api_server_reads_them():
    assert [quantity_value(q) for q in ("2Gi", "500m", "1.5", "1e3", 4, "512M")] == [2**31, 0.5, 1.5, 1000.0, 4.0, 5.12e8]
    assert quantity_value("two") is None and quantity_value("2 Gi") is None


def test_model_source_is_required_and_pvc_urls_are_checked():
    with pytest.raises(SpecError, match="spec.model.source: is required"):
        parse({})
    with pytest.raises(SpecError, match="pvc://<claim-name>"):
        parse({"model": {"source": "pvc://Bad_Claim/x"}})
    assert parse({"model": {"source": "pvc://models/llama/8b"}}).pvc_claim == "models"


def test_names_that_cannot_prefix_pods_are_refused():
    with pytest.raises(SpecError, match="metadata.name"):
        parse({"model": {"source": "x"}}, name="a" * 41)
    with pytest.raises(SpecError, match="metadata.name"):
        parse({"model": {"source": "x"}}, name="9lives")


def test_owned_flags_match_the_crd_rule():
    rule = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"][
        "x-kubernetes-validations"
    ][0]["rule"]
    for flag in OWNED_FLAGS:
        assert flag.removeprefix("--") in rule


def test_ranks_per_pod_follows_gpus_and_may_be_set_for_cpu_pods():
    assert parse({"model": {"source": "x"}, "parallelism": {"tensor": 4, "gpusPerPod": 4}}).ranks_per_pod == 4
    cpu = parse({"model": {"source": "x"}, "parallelism": {"tensor": 2, "gpusPerPod": 0, "ranksPerPod": 2}})
    assert (cpu.ranks_per_pod, cpu.pods_per_group) == (2, 1)


def test_fetched_sources_and_their_secrets():
    spec = parse(
        {"model": {"source": "hf://org/model@v2", "tokenSecret": {"name": "hf"}}, "engine": {"apiKeySecret": {"name": "k"}}}
    )
    assert spec.fetched
    assert (spec.model_token_secret.name, spec.model_token_secret.key) == ("hf", "token")
    assert (spec.api_key_secret.name, spec.api_key_secret.key) == ("k", "api-key")
    assert not parse({"model": {"source": "smollm2"}}).fetched
