"""Pure builders: the objects an LLMService turns into, and the engine pod contract (docs/KUBERNETES.md)."""

from __future__ import annotations

import ast
import base64
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from k8s_harness import CHART

from lockstep_operator import builders, names, pods
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import LABEL_POD_INDEX, LABEL_REVISION
from lockstep_operator.spec import parse_spec
from pod_security import violations

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
    sts = pods.group_statefulset(OWNER, spec, 1, CONFIG)
    assert sts["metadata"]["name"] == "llama-g1"
    assert sts["spec"]["replicas"] == 4
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    # Only the operator replaces pods, and then always the whole group.
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["serviceName"] == "llama-g1"


def test_engine_pod_contract_env():
    spec = spec_of(parallelism={"tensor": 4, "pipeline": 2, "gpusPerPod": 2})
    env = env_of(pods.group_statefulset(OWNER, spec, 1, CONFIG))
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
    args = container(pods.group_statefulset(OWNER, spec, 0, CONFIG))["args"]
    assert args == [
        "random:llama-3-8b", "--port", "8000", "--served-model-name", "llama",
        "--num-scheduler-steps", "16", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--max-num-seqs", "128", "--max-model-len", "4096", "--shutdown-grace-period", "50", "--dtype", "bfloat16",
    ]  # fmt: skip


def test_adaptive_decode_passes_auto():
    args = pods.engine_args(spec_of(decode={"adaptive": True}))
    assert args[args.index("--num-scheduler-steps") + 1] == "auto"


def test_probes_are_sized_from_the_startup_budget_and_go_through_the_launcher():
    sts = pods.group_statefulset(OWNER, spec_of(startup={"timeoutSeconds": 905}), 0, CONFIG)
    engine = container(sts)
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] >= 905
    assert engine["startupProbe"]["failureThreshold"] == 91
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["exec"]["command"] == ["python3", "/etc/lockstep/launch.py", "--probe"]


def test_dev_shm_is_a_memory_volume_sized_per_rank():
    sts = pods.group_statefulset(OWNER, spec_of(parallelism={"tensor": 4, "gpusPerPod": 4}), 0, CONFIG)
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(sts)["volumeMounts"]


def test_gpus_per_pod_becomes_a_gpu_limit_unless_set():
    assert container(
        pods.group_statefulset(OWNER, spec_of(parallelism={"tensor": 2, "gpusPerPod": 2}), 0, CONFIG)
    )["resources"] == {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"nvidia.com/gpu": 2}}
    cpu = spec_of(parallelism={"gpusPerPod": 0}, engine={"resources": {"requests": {"cpu": "2"}}})
    assert container(pods.group_statefulset(OWNER, cpu, 0, CONFIG))["resources"] == {
        "requests": {"cpu": "2"}
    }


def test_pvc_model_is_mounted_read_only_and_passed_as_a_path():
    spec = spec_of(model={"source": "pvc://weights/llama/8b"})
    sts = pods.group_statefulset(OWNER, spec, 0, CONFIG)
    assert container(sts)["args"][0] == "/models/weights/llama/8b"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_user_labels_reach_pods_but_never_selectors():
    spec = spec_of(template={"labels": {"team": "search"}, "nodeSelector": {"gpu": "h200"}})
    sts = pods.group_statefulset(OWNER, spec, 0, CONFIG)
    assert sts["spec"]["template"]["metadata"]["labels"]["team"] == "search"
    assert "team" not in sts["spec"]["selector"]["matchLabels"]
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h200"}


def test_every_child_is_controlled_by_the_llmservice():
    spec = spec_of()
    objects = [
        *builders.service_objects(OWNER, spec, CONFIG),
        builders.group_secret(OWNER, spec),
        builders.group_service(OWNER, spec, 0),
        builders.group_policy(OWNER, spec, 0),
        pods.group_statefulset(OWNER, spec, 0, CONFIG),
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
        names.leader_selector_string("llama")
        == "apps.kubernetes.io/pod-index=0,serving.lockstep.dev/service=llama"
    )


def test_revision_ignores_replicas_and_follows_everything_else():
    base = pods.revision(spec_of(replicas=1), "prod", CONFIG)
    assert pods.revision(spec_of(replicas=5), "prod", CONFIG) == base
    assert pods.revision(spec_of(decode={"numSchedulerSteps": 4}), "prod", CONFIG) != base
    assert (
        pods.revision(spec_of(engine={"image": "registry.example/lockstep:9.9.10"}), "prod", CONFIG)
        != base
    )
    sts = pods.group_statefulset(OWNER, spec_of(), 3, CONFIG)
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
    fetched = spec_of(
        model={"source": "hf://org/model@v1", "tokenSecret": {"name": "hf"}, "cache": {"claimName": "models"}},
        engine={"apiKeySecret": {"name": "engine-key"}},
    )
    objects = [
        *builders.service_objects(OWNER, spec, CONFIG),
        builders.group_secret(OWNER, spec),
        builders.group_service(OWNER, spec, index),
        builders.group_policy(OWNER, spec, index),
        pods.group_statefulset(OWNER, spec, index, CONFIG),
        pods.group_statefulset(OWNER, fetched, index, CONFIG),
    ]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def pod_spec(sts):
    return sts["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"parallelism": {"tensor": 4, "pipeline": 2, "gpusPerPod": 4}},
        {"model": {"source": "pvc://weights/llama"}},
        {
            "model": {
                "source": "hf://org/model@v1",
                "endpoint": "https://hf-mirror.example",
                "tokenSecret": {"name": "hf-token", "key": "token"},
                "cache": {"claimName": "model-cache"},
            },
            "engine": {"apiKeySecret": {"name": "engine-key"}},
        },
        {"model": {"source": "https://models.example/smollm2.tar.gz"}},
    ],
    ids=["cpu", "tp4-pp2-gpu", "pvc", "hf-fetch", "url-fetch"],
)
def test_engine_pods_pass_the_restricted_pod_security_standard(fields):
    sts = pods.group_statefulset(OWNER, spec_of(**fields), 0, CONFIG)
    pod = pod_spec(sts)
    assert violations(pod) == []
    for item in [*pod.get("initContainers", []), *pod["containers"]]:
        assert item["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_pss_check_catches_what_the_standard_forbids():
    """The checker itself: a pod that breaks the profile is reported control by control."""
    pod = {
        "hostNetwork": True,
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [{"name": "c", "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}],
    }
    found = " | ".join(violations(pod))
    for control in (
        "Host Namespaces", "HostPath Volumes", "Volume Types", "Privileged Containers", "Privilege Escalation",
        "Running as Non-root", "Seccomp", "Capabilities: container c does not drop ALL",
        "Capabilities: container c adds ['SYS_ADMIN']",
    ):  # fmt: skip
        assert control in found


def test_every_cache_and_home_is_in_a_writable_volume():
    sts = pods.group_statefulset(OWNER, spec_of(), 0, CONFIG)
    env = env_of(sts)
    mounts = {m["mountPath"]: m for m in container(sts)["volumeMounts"]}
    for name in ("HOME", "XDG_CACHE_HOME", "LOCKSTEP_CACHE", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[name].startswith("/var/cache/lockstep"), name
    assert not mounts["/var/cache/lockstep"].get("readOnly")
    assert not mounts["/tmp"].get("readOnly")
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert volumes["cache"] == {"name": "cache", "emptyDir": {}}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}


def test_every_pod_gets_the_group_secret_as_a_file():
    spec = spec_of(parallelism={"tensor": 2, "gpusPerPod": 1})
    sts = pods.group_statefulset(OWNER, spec, 0, CONFIG)
    assert env_of(sts)["LOCKSTEP_GROUP_SECRET_FILE"] == "/var/run/lockstep/group/secret"
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert volumes["group-secret"]["secret"]["secretName"] == "llama-group-secret"
    assert {"name": "group-secret", "mountPath": "/var/run/lockstep/group", "readOnly": True} in container(sts)[
        "volumeMounts"
    ]
    first, second = builders.group_secret(OWNER, spec), builders.group_secret(OWNER, spec)
    assert first["metadata"]["name"] == "llama-group-secret"
    key = base64.b64decode(first["data"]["secret"])
    assert len(base64.b64decode(key)) == 32  # 32 random bytes, as base64 text in the file
    assert first["data"] != second["data"]


def test_an_api_key_secret_reaches_the_engine_as_its_api_key():
    sts = pods.group_statefulset(OWNER, spec_of(engine={"apiKeySecret": {"name": "engine-key"}}), 0, CONFIG)
    assert env_of(sts)["LOCKSTEP_API_KEY"] == {"secretKeyRef": {"name": "engine-key", "key": "api-key"}}
    assert "LOCKSTEP_API_KEY" not in env_of(pods.group_statefulset(OWNER, spec_of(), 0, CONFIG))


def test_the_http_policy_admits_engine_clients_and_monitoring_only():
    config = OperatorConfig(
        engine_image=CONFIG.engine_image, engine_client_namespaces=("lockstep-system",), monitoring_namespaces=("monitoring",)
    )
    policy = builders.engine_http_policy(OWNER, spec_of(), config)
    assert policy["spec"]["podSelector"] == {"matchLabels": {"serving.lockstep.dev/service": "llama"}}
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    gateway, monitoring = rule["from"]
    assert gateway["podSelector"] == {"matchLabels": {"serving.lockstep.dev/engine-client": "true"}}
    assert gateway["namespaceSelector"]["matchExpressions"][0]["values"] == ["lockstep-system"]
    assert "podSelector" not in monitoring
    assert monitoring["namespaceSelector"]["matchExpressions"][0]["values"] == ["monitoring"]


def test_group_ports_are_open_to_the_same_group_only():
    policy = builders.group_policy(OWNER, spec_of(), 3)
    selector = {"serving.lockstep.dev/service": "llama", "serving.lockstep.dev/group": "3"}
    assert policy["spec"]["podSelector"] == {"matchLabels": selector}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]


def test_network_policies_can_be_turned_off():
    config = OperatorConfig(engine_image=CONFIG.engine_image, network_policy=False)
    assert [o["kind"] for o in builders.service_objects(OWNER, spec_of(), config)] == [
        "ConfigMap", "Service", "PodDisruptionBudget"]  # fmt: skip


def test_tp4_pp2_with_four_gpus_per_pod_is_two_pods_of_four_ranks():
    spec = spec_of(
        parallelism={"tensor": 4, "pipeline": 2, "gpusPerPod": 4},
        engine={"shmSize": "16Gi"},
        template={"runtimeClassName": "nvidia"},
        model={"source": "pvc://weights/llama-3-70b"},
    )
    sts = pods.group_statefulset(OWNER, spec, 0, CONFIG)
    engine = container(sts)
    env = env_of(sts)
    assert sts["spec"]["replicas"] == 2
    assert (env["LOCKSTEP_WORLD_SIZE"], env["LOCKSTEP_RANKS_PER_POD"]) == ("8", "4")
    assert engine["resources"] == {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"nvidia.com/gpu": 4}}
    assert pod_spec(sts)["runtimeClassName"] == "nvidia"
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    args = engine["args"]
    assert args[0] == "/models/weights/llama-3-70b"
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert engine["command"] == ["python3", "/etc/lockstep/launch.py"]


def test_cpu_ranks_per_pod_put_a_tp2_group_in_one_pod():
    spec = spec_of(parallelism={"tensor": 2, "gpusPerPod": 0, "ranksPerPod": 2})
    sts = pods.group_statefulset(OWNER, spec, 0, CONFIG)
    assert sts["spec"]["replicas"] == 1
    assert env_of(sts)["LOCKSTEP_RANKS_PER_POD"] == "2"
    assert "nvidia.com/gpu" not in container(sts)["resources"].get("limits", {})


@pytest.mark.parametrize(
    ("source", "model_arg"),
    [
        ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", ""),
        ("https://models.example/path/SmolLM2.Q4_1.gguf", "/SmolLM2.Q4_1.gguf"),
        ("https://models.example/smollm2.tar.gz", ""),
    ],
)
def test_fetched_models_come_from_an_init_container_into_the_models_volume(source, model_arg):
    spec = spec_of(model={"source": source, "endpoint": "https://mirror.example", "tokenSecret": {"name": "hf"}})
    sts = pods.group_statefulset(OWNER, spec, 0, CONFIG)
    (init,) = pod_spec(sts)["initContainers"]
    init_env = {e["name"]: e.get("value") for e in init["env"]}
    directory = init_env["LOCKSTEP_MODEL_DIR"]
    assert directory.startswith("/models/fetched/")
    assert init_env["LOCKSTEP_MODEL_SOURCE"] == source
    assert init_env["HF_ENDPOINT"] == "https://mirror.example"
    assert init_env["LOCKSTEP_MODEL_TOKEN_FILE"] == "/var/run/lockstep/model-token/token"
    assert init["command"] == ["python3", "/etc/lockstep/fetch.py"]
    assert container(sts)["args"][0] == directory + model_arg
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}
    assert volumes["model-token"]["secret"]["secretName"] == "hf"


def test_a_cache_claim_keeps_fetched_models_across_restarts():
    spec = spec_of(model={"source": "hf://org/m", "cache": {"claimName": "model-cache"}})
    volumes = {v["name"]: v for v in pod_spec(pods.group_statefulset(OWNER, spec, 0, CONFIG))["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "model-cache"}


def test_the_gpu_example_is_two_pods_of_four_gpus():
    example = yaml.safe_load((CHART / "examples" / "llmservice-gpu.yaml").read_text())
    spec = parse_spec(example["metadata"]["name"], example["spec"], default_image=CONFIG.engine_image)
    sts = pods.group_statefulset({**OWNER, "metadata": {**OWNER["metadata"], "name": "llama-70b"}}, spec, 0, CONFIG)
    assert (sts["spec"]["replicas"], env_of(sts)["LOCKSTEP_RANKS_PER_POD"]) == (2, "4")
    assert container(sts)["resources"]["limits"] == {"memory": "200Gi", "nvidia.com/gpu": 4}
    assert violations(pod_spec(sts)) == []
    kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


def test_user_env_overrides_a_cache_variable_without_a_duplicate():
    sts = pods.group_statefulset(OWNER, spec_of(engine={"env": [{"name": "HF_HOME", "value": "/cache"}]}), 0, CONFIG)
    names = [e["name"] for e in container(sts)["env"]]
    assert names.count("HF_HOME") == 1
    assert env_of(sts)["HF_HOME"] == "/cache"


def test_engine_pods_without_resources_get_default_requests_and_no_limits():
    engine = container(pods.group_statefulset(OWNER, spec_of(parallelism={"gpusPerPod": 0}), 0, CONFIG))
    assert engine["resources"] == {"requests": {"cpu": "1", "memory": "4Gi"}}


def test_the_termination_grace_period_is_the_pods_and_the_engine_drains_within_it():
    sts = pods.group_statefulset(OWNER, spec_of(engine={"terminationGracePeriodSeconds": 600}), 0, CONFIG)
    assert pod_spec(sts)["terminationGracePeriodSeconds"] == 600
    args = container(sts)["args"]
    assert args[args.index("--shutdown-grace-period") + 1] == "590"
    assert pod_spec(pods.group_statefulset(OWNER, spec_of(), 0, CONFIG))["terminationGracePeriodSeconds"] == 60


def test_one_disruption_budget_covers_every_engine_pod_of_the_service():
    budget = builders.disruption_budget(OWNER, spec_of(parallelism={"tensor": 2, "gpusPerPod": 1}))
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"serving.lockstep.dev/service": "llama"}},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    assert budget["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    off = spec_of(disruptionBudget={"enabled": False})
    assert "PodDisruptionBudget" not in [o["kind"] for o in builders.service_objects(OWNER, off, CONFIG)]


def test_the_configmap_carries_the_in_pod_programs_as_they_are_in_the_package():
    """The pods run /etc/lockstep/launch.py and fetch.py from the ConfigMap: the text of the modules
    in lockstep_operator/inpod/, byte for byte, whatever engine image the pods use."""
    inpod = Path(builders.__file__).parent / "inpod"
    configmap = builders.engine_configmap(OWNER, spec_of())
    assert configmap["metadata"]["name"] == "llama-engine"
    assert configmap["data"]["launch.py"] == (inpod / "launch.py").read_text(encoding="utf-8")
    assert configmap["data"]["fetch.py"] == (inpod / "fetch.py").read_text(encoding="utf-8")
    sts = pods.group_statefulset(OWNER, spec_of(), 0, CONFIG)
    assert {"name": "launcher", "configMap": {"name": "llama-engine", "defaultMode": 0o444}} in pod_spec(sts)["volumes"]


def test_a_change_to_an_in_pod_program_changes_the_group_revision(monkeypatch):
    spec = spec_of()
    before = pods.revision(spec, "prod", CONFIG)
    monkeypatch.setattr(pods, "LAUNCHER", pods.LAUNCHER + "\n# changed\n")
    assert pods.revision(spec, "prod", CONFIG) != before


@pytest.mark.parametrize("program", ["launch.py", "fetch.py"])
def test_the_in_pod_programs_import_only_the_standard_library(program):
    """They run with the engine image's bare python3, outside any package: a third-party or Lockstep
    import would fail only in the pod."""
    tree = ast.parse((Path(builders.__file__).parent / "inpod" / program).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or ".").split(".")[0] or "." for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
