"""Pure builders: the objects an LLMService turns into, and the engine pod contract (DESIGN.md 5.4)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from lockstep_operator import builders
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import LABEL_POD_INDEX, LABEL_REVISION
from lockstep_operator.spec import parse_spec

CONFIG = OperatorConfig(engine_image="registry.example/lockstep:9.9.9")
OWNER = {"metadata": {"name": "llama", "namespace": "prod", "uid": "0b4c-uid", "generation": 1}}
K8S_VERSION = "1.37.0"


def spec_of(**fields):
    raw = {"model": {"source": "random:llama-3-8b"}, **fields}
    return parse_spec("llama", raw, default_image=CONFIG.engine_image)


def container(sts):
    return sts["spec"]["template"]["spec"]["containers"][0]


def env_of(sts):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(sts)["env"]}


def test_statefulset_has_one_pod_per_rank_slot_started_together():
    spec = spec_of(parallelism={"tensor": 4, "pipeline": 2, "gpusPerPod": 2})
    sts = builders.group_statefulset(OWNER, spec, 1, CONFIG)
    assert sts["metadata"]["name"] == "llama-g1"
    assert sts["spec"]["replicas"] == 4
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    # Only the operator replaces pods, and then always the whole group.
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["serviceName"] == "llama-g1"


def test_engine_pod_contract_env():
    spec = spec_of(parallelism={"tensor": 4, "pipeline": 2, "gpusPerPod": 2})
    env = env_of(builders.group_statefulset(OWNER, spec, 1, CONFIG))
    assert env["LOCKSTEP_WORLD_SIZE"] == "8"
    assert env["LOCKSTEP_RANKS_PER_POD"] == "2"
    assert env["LOCKSTEP_GROUP"] == "1"
    assert env["LOCKSTEP_LEADER_ADDR"] == "llama-g1-0.llama-g1.prod.svc.cluster.local"
    assert env["LOCKSTEP_POD_INDEX"] == {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_POD_INDEX}']"}}


def test_engine_args_carry_steps_and_parallelism():
    spec = spec_of(
        decode={"numSchedulerSteps": 16},
        parallelism={"tensor": 2, "pipeline": 2, "gpusPerPod": 1},
        engine={"maxNumSeqs": 128, "maxModelLen": 4096, "extraArgs": ["--dtype", "bfloat16"]},
    )
    args = container(builders.group_statefulset(OWNER, spec, 0, CONFIG))["args"]
    assert args == [
        "random:llama-3-8b", "--port", "8000", "--served-model-name", "llama",
        "--num-scheduler-steps", "16", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--max-num-seqs", "128", "--max-model-len", "4096", "--dtype", "bfloat16",
    ]  # fmt: skip


def test_adaptive_decode_passes_auto():
    args = builders.engine_args(spec_of(decode={"adaptive": True}))
    assert args[args.index("--num-scheduler-steps") + 1] == "auto"


def test_probes_are_sized_from_the_startup_budget_and_go_through_the_launcher():
    sts = builders.group_statefulset(OWNER, spec_of(startup={"timeoutSeconds": 905}), 0, CONFIG)
    engine = container(sts)
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 905
    assert engine["startupProbe"]["failureThreshold"] == 91
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["exec"]["command"] == ["/bin/sh", "/etc/lockstep/launch.sh", "--probe"]


def test_dev_shm_is_a_memory_volume_sized_per_rank():
    sts = builders.group_statefulset(OWNER, spec_of(parallelism={"tensor": 4, "gpusPerPod": 4}), 0, CONFIG)
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(sts)["volumeMounts"]


def test_gpus_per_pod_becomes_a_gpu_limit_unless_set():
    assert container(
        builders.group_statefulset(OWNER, spec_of(parallelism={"tensor": 2, "gpusPerPod": 2}), 0, CONFIG)
    )["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    cpu = spec_of(parallelism={"gpusPerPod": 0}, engine={"resources": {"requests": {"cpu": "2"}}})
    assert container(builders.group_statefulset(OWNER, cpu, 0, CONFIG))["resources"] == {
        "requests": {"cpu": "2"}
    }


def test_pvc_model_is_mounted_read_only_and_passed_as_a_path():
    spec = spec_of(model={"source": "pvc://weights/llama/8b"})
    sts = builders.group_statefulset(OWNER, spec, 0, CONFIG)
    assert container(sts)["args"][0] == "/models/weights/llama/8b"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_user_labels_reach_pods_but_never_selectors():
    spec = spec_of(template={"labels": {"team": "search"}, "nodeSelector": {"gpu": "h200"}})
    sts = builders.group_statefulset(OWNER, spec, 0, CONFIG)
    assert sts["spec"]["template"]["metadata"]["labels"]["team"] == "search"
    assert "team" not in sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h200"}


def test_every_child_is_controlled_by_the_llmservice():
    spec = spec_of()
    objects = [
        *builders.service_objects(OWNER, spec),
        builders.group_service(OWNER, spec, 0),
        builders.group_statefulset(OWNER, spec, 0, CONFIG),
    ]
    for obj in objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "serving.lockstep.dev/v1alpha1", "kind": "LLMService", "name": "llama",
            "uid": "0b4c-uid", "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip


def test_headless_service_publishes_unready_pods_so_workers_find_the_leader():
    svc = builders.group_service(OWNER, spec_of(), 2)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {
        "serving.lockstep.dev/service": "llama",
        "serving.lockstep.dev/group": "2",
    }


def test_leader_service_selects_pod_zero_of_every_group():
    svc = builders.leader_service(OWNER, spec_of())
    assert svc["spec"]["selector"] == {"serving.lockstep.dev/service": "llama", LABEL_POD_INDEX: "0"}
    assert (
        builders.leader_selector_string("llama")
        == "apps.kubernetes.io/pod-index=0,serving.lockstep.dev/service=llama"
    )


def test_revision_ignores_replicas_and_follows_everything_else():
    base = builders.revision(spec_of(replicas=1), "prod", CONFIG)
    assert builders.revision(spec_of(replicas=5), "prod", CONFIG) == base
    assert builders.revision(spec_of(decode={"numSchedulerSteps": 4}), "prod", CONFIG) != base
    assert (
        builders.revision(spec_of(engine={"image": "registry.example/lockstep:9.9.10"}), "prod", CONFIG)
        != base
    )
    sts = builders.group_statefulset(OWNER, spec_of(), 3, CONFIG)
    assert sts["spec"]["template"]["metadata"]["labels"][LABEL_REVISION] == base


@pytest.mark.parametrize("index", [0, 1])
def test_built_objects_validate_against_the_kubernetes_schemas(index):
    spec = spec_of(
        parallelism={"tensor": 2, "pipeline": 2, "gpusPerPod": 2},
        engine={
            "env": [{"name": "HF_HOME", "value": "/cache"}],
            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
        },
        template={
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "high",
        },
        model={"source": "pvc://weights/m"},
    )
    objects = [
        *builders.service_objects(OWNER, spec),
        builders.group_service(OWNER, spec, index),
        builders.group_statefulset(OWNER, spec, index, CONFIG),
    ]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
