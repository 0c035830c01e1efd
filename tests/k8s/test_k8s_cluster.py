"""LLMService end to end on a real kube-apiserver + etcd + kube-controller-manager, driven by kubectl.

There is no kubelet: pods stay Pending until a test writes their status through the status
subresource, as a kubelet would ("Running", condition Ready, container restart counts).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from k8s_harness import CHART, EXAMPLE, RELEASE_VALUES, wait_for

pytestmark = pytest.mark.timeout(300)

GROUP_LABEL = "serving.lockstep.dev/group"


def example(name: str = "smollm2", **spec: Any) -> dict[str, Any]:
    """The shipped example as a group of two pods (TP=2, one rank each): the tests restart, roll and
    admit multi-pod groups."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["parallelism"] = {"tensor": 2, "pipeline": 1, "gpusPerPod": 0}
    manifest["spec"].update(copy.deepcopy(spec))
    return manifest


def pods_of(kubectl, namespace: str, name: str, group: int | None = None) -> list[dict[str, Any]]:
    selector = f"serving.lockstep.dev/service={name}" + (
        f",{GROUP_LABEL}={group}" if group is not None else ""
    )
    return kubectl.get("pods", "-n", namespace, "-l", selector)["items"]


def set_pod_status(kube, namespace: str, pod: dict[str, Any], ready: bool = True, restarts: int = 0) -> None:
    """Do what the kubelet would: report the pod running, ready or not, with its restart count."""
    container = pod["spec"]["containers"][0]
    status = {
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": str(ready)},
            {"type": "Ready", "status": str(ready)},
        ],
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": ready,
                "restartCount": restarts,
                "started": True,
                "state": {"running": {"startedAt": "2026-11-29T00:00:00Z"}},
            }
        ],
    }
    kube.patch_namespaced_pod_status(pod["metadata"]["name"], namespace, {"status": status})


def make_ready(
    kubectl, kube, namespace: str, name: str, group: int | None = None, count: int | None = None
) -> None:
    """Wait for the group's pods to exist (the StatefulSet controller makes them), then mark them ready.

    Only pods of the group's current StatefulSet with its current template count: after a spec change the
    old pods can outlive their StatefulSet for a while (the garbage collector removes them), and marking one
    of those ready would leave the new ones unready."""
    expected = count if count is not None else None

    def current(pod: dict[str, Any]) -> bool:
        sts = statefulset(kubectl, namespace, f"{name}-g{pod['metadata']['labels'][GROUP_LABEL]}")
        owners = {ref["uid"] for ref in pod["metadata"].get("ownerReferences", [])}
        return sts is not None and sts["metadata"]["uid"] in owners and \
            pod["spec"]["containers"][0].get("args") == sts["spec"]["template"]["spec"]["containers"][0].get("args")

    def all_pods():
        pods = [
            p for p in pods_of(kubectl, namespace, name, group)
            if not p["metadata"].get("deletionTimestamp") and current(p)
        ]
        return pods if pods and (expected is None or len(pods) == expected) else None

    for pod in wait_for(f"pods of {name} group {group}", all_pods, timeout=60):
        set_pod_status(kube, namespace, pod)


def service(kubectl, namespace: str, name: str) -> dict[str, Any]:
    return kubectl.get("llmservice", name, "-n", namespace)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)


def wait_ready(kubectl, namespace: str, name: str, replicas: int, timeout: float = 60) -> dict[str, Any]:
    def ready():
        obj = service(kubectl, namespace, name)
        status = obj.get("status", {})
        ok = (
            (condition(obj, "Ready") or {}).get("status") == "True"
            and status.get("observedGeneration") == obj["metadata"]["generation"]
            and status.get("readyReplicas") == replicas
            and status.get("updatedReplicas") == replicas
        )
        return obj if ok else None

    return wait_for(f"{name} Ready with {replicas} groups", ready, timeout=timeout)


def statefulset(kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    result = kubectl.run("get", "statefulset", name, "-n", namespace, "-o", "json", check=False)
    return None if result.returncode else yaml.safe_load(result.stdout)


def steps_arg(sts: dict[str, Any]) -> str:
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--num-scheduler-steps") + 1]


# --- the chart -------------------------------------------------------------------------------


def test_helm_installs_the_chart_with_its_crd(release, kubectl):
    assert release["status"] == "deployed"
    crd = kubectl.get("crd", "llmservices.serving.lockstep.dev")
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]
    deployments = {
        d["metadata"]["name"] for d in kubectl.get("deployments", "-n", "lockstep-system")["items"]
    }
    assert deployments == {"lockstep-operator", "lockstep-gateway"}
    assert kubectl.get("configmap", "lockstep-dashboard", "-n", "lockstep-system")["data"][
        "lockstep.json"
    ].startswith("{")


def test_the_documented_upgrade_path_works(release, control_plane, kubectl):
    import helm_python as helm

    # docs/KUBERNETES.md: apply the chart's CRD yourself, then `helm upgrade`.
    kubectl.run("apply", "--server-side", "-f", str(CHART / "crds"))
    with helm.Config(kubeconfig_path=str(control_plane.kubeconfig), namespace="lockstep-system") as cfg:
        upgraded = cfg.upgrade(
            str(CHART), "lockstep", RELEASE_VALUES, reuse_values=False, timeout=120
        )
    assert upgraded["status"] == "deployed" and upgraded["revision"] == 2
    kubectl.run(
        "wait", "--for=condition=Established", "crd/llmservices.serving.lockstep.dev", "--timeout=30s"
    )


# --- validation by the API server ------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"decode": {"numSchedulerSteps": 0}},
            "spec.decode.numSchedulerSteps: Invalid value: 0: spec.decode.numSchedulerSteps in body should be greater than or equal to 1",
        ),
        ({"decode": {"numSchedulerSteps": 65}}, "should be less than or equal to 64"),
        (
            {"parallelism": {"tensor": 3, "pipeline": 1, "gpusPerPod": 2}},
            "parallelism.tensor * parallelism.pipeline (3) must be divisible by parallelism.gpusPerPod (2)",
        ),
        ({"replicas": -1}, "spec.replicas in body should be greater than or equal to 0"),
        (
            {"decode": {"adaptive": True, "numSchedulerSteps": 8}},
            "decode.numSchedulerSteps cannot be set together with decode.adaptive: true",
        ),
        ({"engine": {"extraArgs": ["--tensor-parallel-size=4"]}}, "engine.extraArgs must not set --port"),
        ({"fooBar": 1}, 'unknown field "spec.fooBar"'),
        ({"engine": {"shmSize": "lots"}}, "spec.engine.shmSize: Invalid value"),
        ({"engine": {"resources": {"requests": {"cpu": "two"}}}}, "spec.engine.resources.requests[cpu]: Invalid value"),
        ({"rollout": {"maxSurge": "lots"}}, "rollout.maxSurge must be a count in 0..1024 or a percentage"),
        ({"rollout": {"maxUnavailable": "150%"}}, "rollout.maxUnavailable must be a count in 0..1024 or a percentage"),
        ({"engine": {"terminationGracePeriodSeconds": 1}}, "spec.engine.terminationGracePeriodSeconds: Invalid value"),
        ({"speculativeConfig": {"method": "eagle", "numSpeculativeTokens": 3}},
         'spec.speculativeConfig.method: Unsupported value: "eagle"'),
        ({"speculativeConfig": {"method": "draft_model", "numSpeculativeTokens": 3}},
         "speculativeConfig.model is required with method draft_model"),
        ({"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 2, "promptLookupMin": 4}},
         "speculativeConfig.promptLookupMin must be at most promptLookupMax"),
        ({"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 3},
          "parallelism": {"tensor": 2, "pipeline": 1, "gpusPerPod": 2}},
         "spec.speculativeConfig needs parallelism.tensor = parallelism.pipeline = 1"),
        ({"engine": {"extraArgs": ["--speculative-config={}"]}}, "--served-model-name or --speculative-config"),
    ],
    ids=[
        "steps-0",
        "steps-65",
        "tp-not-divisible",
        "negative-replicas",
        "adaptive-and-steps",
        "owned-flag",
        "unknown-field",
        "shm-not-a-quantity",
        "cpu-not-a-quantity",
        "surge-not-a-percentage",
        "unavailable-over-100-percent",
        "grace-too-short",
        "speculative-method-unknown",
        "speculative-draft-without-model",
        "speculative-lookup-min-over-max",
        "speculative-with-tensor-parallel",
        "speculative-flag-in-extra-args",
    ],
)
def test_the_api_server_rejects_invalid_specs(release, kubectl, namespace, change, message):
    result = kubectl.apply(example("bad", **change), namespace, check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert kubectl.get("llmservices", "-n", namespace)["items"] == []


def test_a_name_that_cannot_prefix_pods_is_refused_naming_metadata_name(release, kubectl, namespace):
    result = kubectl.apply({**example(), "metadata": {"name": "Not_A_Label"}}, namespace, check=False)
    assert result.returncode != 0
    assert "metadata.name: Invalid value" in result.stderr and "<nil>" not in result.stderr, result.stderr


def test_every_spec_field_has_a_description_in_kubectl_explain(release, kubectl):
    text = kubectl.run("explain", "llmservice.spec", "--recursive=false").stdout
    assert "DESCRIPTION" in text and "What to serve" in text
    for field in ("decode", "parallelism", "engine", "disruptionBudget"):
        explained = kubectl.run("explain", f"llmservice.spec.{field}").stdout
        assert "<empty>" not in explained.split("FIELDS")[0], explained


def test_defaults_are_filled_by_the_api_server(release, kubectl, namespace):
    kubectl.apply(
        {
            "apiVersion": "serving.lockstep.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "tiny"},
            "spec": {"model": {"source": "random:tiny"}},
        },
        namespace,
    )
    spec = service(kubectl, namespace, "tiny")["spec"]
    assert spec["parallelism"] == {"tensor": 1, "pipeline": 1, "gpusPerPod": 1}
    assert spec["replicas"] == 1
    assert spec["decode"] == {"adaptive": False}
    assert spec["startup"] == {"timeoutSeconds": 1800}


# --- the operator ----------------------------------------------------------------------------


def test_kubectl_apply_of_the_example_creates_its_engine_group(operator, kubectl, namespace):
    kubectl.run("apply", "-n", namespace, "-f", str(EXAMPLE))
    sts = wait_for("StatefulSet smollm2-g0", lambda: statefulset(kubectl, namespace, "smollm2-g0"))
    assert sts["spec"]["replicas"] == 1  # tensor 1 x pipeline 1 / one rank per pod
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    assert engine["image"] == "registry.invalid/lockstep:0.1.0-test"
    assert engine["args"][:13] == [
        "smollm2", "--port", "8000", "--served-model-name", "smollm2", "--num-scheduler-steps", "8",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--max-num-seqs", "16",
    ]  # fmt: skip
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["LOCKSTEP_WORLD_SIZE"] == "1"
    assert env["LOCKSTEP_LEADER_ADDR"] == f"smollm2-g0-0.smollm2-g0.{namespace}.svc.cluster.local"
    assert engine["startupProbe"]["failureThreshold"] == 60  # startup.timeoutSeconds 600 / period 10
    assert sts["metadata"]["ownerReferences"][0]["kind"] == "LLMService"

    pods = wait_for(
        "the pod made by the StatefulSet controller",
        lambda: len(pods_of(kubectl, namespace, "smollm2")) == 1 and pods_of(kubectl, namespace, "smollm2"),
    )
    assert [p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] for p in pods] == ["0"]
    headless = kubectl.get("service", "smollm2-g0", "-n", namespace)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    leader = kubectl.get("service", "smollm2", "-n", namespace)
    assert leader["spec"]["selector"] == {
        "apps.kubernetes.io/pod-index": "0",
        "serving.lockstep.dev/service": "smollm2",
    }
    assert {"launch.py", "fetch.py"} <= set(kubectl.get("configmap", "smollm2-engine", "-n", namespace)["data"])


def test_kubectl_get_shows_the_printer_columns(operator, kubectl, kube, namespace):
    kubectl.apply(example("cols", decode={"numSchedulerSteps": 16}), namespace)
    make_ready(kubectl, kube, namespace, "cols", count=2)
    wait_ready(kubectl, namespace, "cols", 1)
    header, row = kubectl.run("get", "llmservices", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "READY", "REPLICAS", "AVAILABLE", "STEPS", "TP", "PP", "AGE"]
    assert row.split()[:7] == ["cols", "True", "1", "1", "16", "2", "1"]
    wide_header = kubectl.run("get", "llmservices", "-n", namespace, "-o", "wide").stdout.splitlines()[0]
    assert "MODEL" in wide_header.split()


def test_ready_pods_make_the_service_ready(operator, kubectl, kube, namespace):
    kubectl.apply(example("ready", replicas=2), namespace)
    obj = service(kubectl, namespace, "ready")
    assert (condition(obj, "Ready") or {"status": "False"})["status"] != "True"
    make_ready(kubectl, kube, namespace, "ready", count=4)
    obj = wait_ready(kubectl, namespace, "ready", 2)
    status = obj["status"]
    assert (status["replicas"], status["podsPerGroup"], status["steps"]) == (2, 2, "8")
    assert status["selector"] == "apps.kubernetes.io/pod-index=0,serving.lockstep.dev/service=ready"
    assert [g["state"] for g in status["groups"]] == ["Ready", "Ready"]
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Available", "Progressing", "Degraded"}
    assert all(c["observedGeneration"] == obj["metadata"]["generation"] for c in status["conditions"])
    kubectl.run("wait", "--for=condition=Ready", "llmservice/ready", "-n", namespace, "--timeout=10s")


def test_scale_adds_groups_and_the_operator_never_writes_spec_replicas(operator, kubectl, kube, namespace):
    kubectl.apply(example("scaled"), namespace)
    make_ready(kubectl, kube, namespace, "scaled", count=2)
    wait_ready(kubectl, namespace, "scaled", 1)
    group0 = {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "scaled", 0)}

    kubectl.run("scale", "llmservice/scaled", "--replicas=3", "-n", namespace)
    for index in (1, 2):
        wait_for(f"group {index}", lambda index=index: statefulset(kubectl, namespace, f"scaled-g{index}"))
    make_ready(kubectl, kube, namespace, "scaled", count=6)
    obj = wait_ready(kubectl, namespace, "scaled", 3)
    assert obj["spec"]["replicas"] == 3
    assert {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "scaled", 0)} == group0  # no rollout
    scale = kubectl.get("llmservice", "scaled", "-n", namespace, "--subresource=scale")
    assert scale["status"] == {
        "replicas": 3,
        "selector": "apps.kubernetes.io/pod-index=0,serving.lockstep.dev/service=scaled",
    }
    # Only kubectl ever wrote spec.replicas; the operator wrote status and nothing else.
    managed = kubectl.get("llmservice", "scaled", "-n", namespace, "--show-managed-fields")["metadata"][
        "managedFields"
    ]
    assert any(entry["manager"] == "lockstep-operator" for entry in managed)
    for entry in managed:
        if entry["manager"] == "lockstep-operator":
            assert entry.get("subresource") == "status", entry

    kubectl.run("scale", "llmservice/scaled", "--replicas=1", "-n", namespace)
    wait_for(
        "groups 1 and 2 removed",
        lambda: (
            statefulset(kubectl, namespace, "scaled-g1") is None
            and statefulset(kubectl, namespace, "scaled-g2") is None
        ),
    )
    wait_ready(kubectl, namespace, "scaled", 1)


def test_a_deleted_member_pod_restarts_its_whole_group(operator, kubectl, kube, namespace):
    kubectl.apply(example("restart", replicas=2), namespace)
    make_ready(kubectl, kube, namespace, "restart", count=4)
    wait_ready(kubectl, namespace, "restart", 2)
    # The operator records a group's members once it is complete.
    wait_for(
        "members recorded",
        lambda: all(
            statefulset(kubectl, namespace, f"restart-g{i}")["metadata"]["annotations"].get(
                "serving.lockstep.dev/members"
            )
            for i in (0, 1)
        ),
    )
    before0 = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "restart", 0)}
    before1 = {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "restart", 1)}
    restarts_before = operator.metric("lockstep_operator_group_restarts_total")

    kubectl.run("delete", "pod", "restart-g0-1", "-n", namespace, "--wait=false")

    def group0_replaced():
        pods = pods_of(kubectl, namespace, "restart", 0)
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        return len(uids) == 2 and all(uids[name] != uid for name, uid in before0.items() if name in uids)

    wait_for("both pods of group 0 replaced", group0_replaced)
    assert {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "restart", 1)} == before1
    obj = wait_for(
        "group 0 reported restarting",
        lambda: (s := service(kubectl, namespace, "restart"))["status"]["groups"][0]["restarts"] == 1 and s,
    )
    assert obj["status"]["groups"][1]["restarts"] == 0
    assert operator.metric("lockstep_operator_group_restarts_total") == restarts_before + 1
    events = kubectl.get("events", "-n", namespace, "--field-selector", "reason=GroupRestart")["items"]
    assert any("restarting group 0" in e["message"] for e in events)

    make_ready(kubectl, kube, namespace, "restart", 0, count=2)
    wait_ready(kubectl, namespace, "restart", 2)


def test_a_restarted_container_restarts_its_whole_group(operator, kubectl, kube, namespace):
    kubectl.apply(example("crash"), namespace)
    make_ready(kubectl, kube, namespace, "crash", count=2)
    wait_ready(kubectl, namespace, "crash", 1)
    before = {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "crash")}
    leader = next(p for p in pods_of(kubectl, namespace, "crash") if p["metadata"]["name"] == "crash-g0-0")
    set_pod_status(
        kube, namespace, leader, ready=False, restarts=1
    )  # the kubelet restarted the leader's container

    def replaced():
        pods = pods_of(kubectl, namespace, "crash")
        return len(pods) == 2 and not ({p["metadata"]["uid"] for p in pods} & before)

    wait_for("the whole group replaced", replaced)
    obj = service(kubectl, namespace, "crash")
    assert (condition(obj, "Ready") or {})["status"] == "False"
    make_ready(kubectl, kube, namespace, "crash", count=2)
    assert wait_ready(kubectl, namespace, "crash", 1)["status"]["groups"][0]["restarts"] == 1


def test_autoscaling_writes_spec_replicas_through_the_scale_subresource(operator, kubectl, kube, namespace):
    # No engine runs here, so the demand is zero: with minReplicas 0 and no delay the service goes to
    # zero once its group is ready (while a group starts, the scale-down delay does not run).
    kubectl.apply(example("auto", autoscaling={"minReplicas": 0, "maxReplicas": 2, "scaleDownDelaySeconds": 0}), namespace)
    make_ready(kubectl, kube, namespace, "auto", count=2)
    obj = wait_for("spec.replicas 0", lambda: (o := service(kubectl, namespace, "auto"))["spec"]["replicas"] == 0 and o)
    wait_for("group 0 removed", lambda: statefulset(kubectl, namespace, "auto-g0") is None)
    status = wait_for("status.autoscaling", lambda: service(kubectl, namespace, "auto")["status"].get("autoscaling"))
    assert status["desiredReplicas"] == 0 and status["waiting"] == 0
    events = kubectl.get("events", "-n", namespace, "--field-selector", "involvedObject.name=auto,reason=Scaled")["items"]
    assert any(e["message"].startswith("scaled from 1 to 0 groups") for e in events), events
    assert obj["metadata"]["generation"] >= 2


def test_a_spec_change_of_one_group_starts_a_surge_group_before_replacing_it(operator, kubectl, kube, namespace):
    kubectl.apply(example("surge"), namespace)
    make_ready(kubectl, kube, namespace, "surge", count=2)
    wait_ready(kubectl, namespace, "surge", 1)
    before = {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "surge", 0)}
    kubectl.run("patch", "llmservice", "surge", "-n", namespace, "--type=merge",
                "-p", '{"spec": {"decode": {"numSchedulerSteps": 4}}}')  # fmt: skip
    extra = wait_for("the surge group", lambda: statefulset(kubectl, namespace, "surge-g1"))
    assert steps_arg(extra) == "4" and extra["metadata"]["annotations"]["serving.lockstep.dev/surge"] == "true"
    obj = wait_for("status shows it", lambda: (s := service(kubectl, namespace, "surge"))["status"]["groups"][1:] and s)
    assert obj["status"]["groups"][1]["surge"] is True
    assert {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "surge", 0)} == before  # still serving
    make_ready(kubectl, kube, namespace, "surge", 1, count=2)
    wait_for("group 0 replaced", lambda: steps_arg(statefulset(kubectl, namespace, "surge-g0")) == "4")
    make_ready(kubectl, kube, namespace, "surge", 0, count=2)
    wait_for("the surge group removed", lambda: statefulset(kubectl, namespace, "surge-g1") is None)
    obj = wait_ready(kubectl, namespace, "surge", 1)
    assert len(obj["status"]["groups"]) == 1 and obj["status"]["updatedReplicas"] == 1


def test_a_spec_change_without_surge_rolls_group_by_group(operator, kubectl, kube, namespace):
    kubectl.apply(example("roll", replicas=2, rollout={"maxSurge": 0, "maxUnavailable": 1}), namespace)
    make_ready(kubectl, kube, namespace, "roll", count=4)
    wait_ready(kubectl, namespace, "roll", 2)
    kubectl.run(
        "patch",
        "llmservice",
        "roll",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec": {"decode": {"numSchedulerSteps": 4}}}',
    )

    def first_group_rolled():
        obj = service(kubectl, namespace, "roll")
        status = obj["status"]
        return status["observedGeneration"] == 2 and status["updatedReplicas"] == 1 and obj

    obj = wait_for("one group updated", first_group_rolled)
    assert (condition(obj, "Progressing") or {})["reason"] == "RollingUpdate"
    assert (condition(obj, "Available") or {})["status"] == "True"
    updated = [g["index"] for g in obj["status"]["groups"] if g["updated"]]
    waiting = 1 - updated[0]
    assert steps_arg(statefulset(kubectl, namespace, f"roll-g{updated[0]}")) == "4"
    # The other group keeps serving the old revision while the first one is not ready.
    assert steps_arg(statefulset(kubectl, namespace, f"roll-g{waiting}")) == "8"
    assert all(
        p["metadata"]["labels"]["serving.lockstep.dev/revision"]
        == statefulset(kubectl, namespace, f"roll-g{waiting}")["metadata"]["labels"][
            "serving.lockstep.dev/revision"
        ]
        for p in pods_of(kubectl, namespace, "roll", waiting)
    )

    make_ready(kubectl, kube, namespace, "roll", updated[0], count=2)
    wait_for(
        "second group updated", lambda: steps_arg(statefulset(kubectl, namespace, f"roll-g{waiting}")) == "4"
    )
    make_ready(kubectl, kube, namespace, "roll", waiting, count=2)
    obj = wait_ready(kubectl, namespace, "roll", 2)
    assert obj["status"]["observedGeneration"] == 2


def test_user_env_and_pod_overrides_reach_the_pods(operator, kubectl, namespace):
    kubectl.apply(
        example(
            "custom",
            engine={"env": [{"name": "HF_HOME", "value": "/cache"}]},
            template={"labels": {"team": "search"}, "nodeSelector": {"pool": "cpu"}},
        ),
        namespace,
    )
    pods = wait_for(
        "pods",
        lambda: len(pods_of(kubectl, namespace, "custom")) == 2 and pods_of(kubectl, namespace, "custom"),
    )
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["HF_HOME"] == "/cache"
        assert pod["metadata"]["labels"]["team"] == "search"
        assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}


def test_a_deleted_leader_service_is_recreated(operator, kubectl, namespace):
    def leader_uid():
        result = kubectl.run("get", "service", "heal", "-n", namespace, "-o", "json", check=False)
        return yaml.safe_load(result.stdout)["metadata"]["uid"] if result.returncode == 0 else None

    kubectl.apply(example("heal"), namespace)
    uid = wait_for("the leader Service", leader_uid)
    kubectl.run("delete", "service", "heal", "-n", namespace)
    wait_for("the leader Service recreated", lambda: leader_uid() not in (None, uid))


def test_a_statefulset_edited_by_hand_is_put_back_without_restarting_pods(operator, kubectl, namespace):
    kubectl.apply(example("drift"), namespace)
    wait_for("pods", lambda: len(pods_of(kubectl, namespace, "drift")) == 2)
    before = {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "drift")}
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "someone/else:1"}]}}}}
    kubectl.run("patch", "statefulset", "drift-g0", "-n", namespace, "-p", json.dumps(patch))

    def image():
        return statefulset(kubectl, namespace, "drift-g0")["spec"]["template"]["spec"]["containers"][0][
            "image"
        ]

    wait_for("the operator's image back", lambda: image() == "registry.invalid/lockstep:0.1.0-test")
    assert {p["metadata"]["uid"] for p in pods_of(kubectl, namespace, "drift")} == before


def test_kopf_leaves_no_bookkeeping_outside_the_project_prefix(operator, kubectl, kube, namespace):
    kubectl.apply(example("tidy"), namespace)
    make_ready(kubectl, kube, namespace, "tidy", count=2)
    obj = wait_ready(kubectl, namespace, "tidy", 1)
    assert not obj["metadata"].get("finalizers")
    assert not [k for k in obj["metadata"].get("annotations", {}) if "kopf" in k]
    assert set(obj["status"]) == {
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "updatedReplicas",
        "selector",
        "podsPerGroup",
        "steps",
        "conditions",
        "groups",
    }


def test_deleting_the_service_removes_what_it_owned(operator, kubectl, kube, namespace):
    kubectl.apply(example("gone", replicas=2), namespace)
    wait_for("both groups", lambda: statefulset(kubectl, namespace, "gone-g1"))
    wait_for("pods", lambda: len(pods_of(kubectl, namespace, "gone")) == 4)
    kubectl.run("delete", "llmservice", "gone", "-n", namespace, "--wait=true", "--timeout=30s")

    def all_gone():
        selector = "serving.lockstep.dev/service=gone"
        left = kubectl.get("statefulsets,services,configmaps,pods", "-n", namespace, "-l", selector)["items"]
        return not left

    wait_for("garbage collection of StatefulSets, Services, ConfigMap and pods", all_gone, timeout=60)


def test_operator_metrics_count_reconciles(operator):
    assert operator.metric("lockstep_operator_reconciles_total") > 0
    assert operator.metric("lockstep_operator_reconcile_duration_seconds_count") > 0


def test_the_chart_rbac_was_enough_for_everything_above(operator):
    # Runs last in this module: the operator ran as the chart's ServiceAccount the whole time.
    log = operator.log_text()
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


# --- security and the reasons pods are missing ------------------------------------------------

PSS_ENFORCE = "pod-security.kubernetes.io/enforce"


def test_the_api_servers_pod_security_admission_admits_the_charts_pods(release, kubectl):
    """lockstep-system enforces "restricted": the ReplicaSet controller's pods exist only if admitted."""
    labels = kubectl.get("namespace", "lockstep-system")["metadata"]["labels"]
    assert labels[PSS_ENFORCE] == "restricted"

    def components():
        pods = kubectl.get("pods", "-n", "lockstep-system")["items"]
        return {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods}

    wait_for("operator and gateway pods admitted", lambda: {"operator", "gateway"} <= components())


def test_engine_pods_pass_restricted_pod_security_admission(operator, kubectl, namespace):
    kubectl.run("label", "namespace", namespace, f"{PSS_ENFORCE}=restricted")
    kubectl.apply(example("locked"), namespace)
    wait_for("both engine pods admitted", lambda: len(pods_of(kubectl, namespace, "locked")) == 2)


def test_the_group_secret_and_network_policies_belong_to_the_llmservice(operator, kubectl, namespace):
    kubectl.apply(example("owned"), namespace)
    found = wait_for(
        "the group Secret",
        lambda: (r := kubectl.run("get", "secret", "owned-group-secret", "-n", namespace, "-o", "json", check=False))
        .returncode == 0 and r,
    )
    secret = json.loads(found.stdout)
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "LLMService"
    assert len(secret["data"]["secret"]) > 40
    def policies():
        items = kubectl.get("networkpolicies", "-n", namespace)["items"]
        return {p["metadata"]["name"] for p in items} == {"owned", "owned-g0"} and items

    policies = wait_for("the NetworkPolicies", policies)
    assert all(p["metadata"]["ownerReferences"][0]["name"] == "owned" for p in policies)
    first_key = secret["data"]["secret"]
    kubectl.run("annotate", "llmservice", "owned", "-n", namespace, "touch=1")  # one more reconcile
    wait_for("the reconcile after the annotation", lambda: service(kubectl, namespace, "owned").get("status"))
    again = kubectl.get("secret", "owned-group-secret", "-n", namespace)
    assert again["data"]["secret"] == first_key  # created once, never rotated by a reconcile


def _degraded(kubectl, namespace: str, name: str, reason: str):
    def check():
        found = condition(service(kubectl, namespace, name), "Degraded")
        return found if found and found["reason"] == reason else None

    return check


def test_a_quota_that_refuses_pods_is_the_reason_in_status(operator, kubectl, namespace):
    kubectl.apply(
        {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "one-pod"}, "spec": {"hard": {"pods": "1"}}},
        namespace,
    )
    # Until the quota controller has counted usage, admission refuses with "status unknown".
    wait_for("the quota counted", lambda: kubectl.get("resourcequota", "one-pod", "-n", namespace).get("status", {}).get("used"))
    kubectl.apply(example("quota"), namespace)  # two pods per group
    degraded = wait_for(
        "Degraded=FailedCreate", _degraded(kubectl, namespace, "quota", "FailedCreate"), timeout=90
    )
    assert "exceeded quota: one-pod" in degraded["message"]
    obj = service(kubectl, namespace, "quota")
    ready = condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "FailedCreate")
    assert "exceeded quota" in obj["status"]["groups"][0]["message"]


def test_a_missing_runtime_class_is_the_reason_in_status(operator, kubectl, namespace):
    kubectl.apply(example("runtime", template={"runtimeClassName": "nvidia"}), namespace)
    degraded = wait_for(
        "Degraded=FailedCreate", _degraded(kubectl, namespace, "runtime", "FailedCreate"), timeout=90
    )
    assert 'RuntimeClass "nvidia" not found' in degraded["message"]


def test_the_default_namespaced_role_grants_the_operator_exactly_its_calls(release, kubectl, namespace):
    """The chart's default RBAC (a Role in the watched namespace), judged by the API server's own
    authorizer: every call the operator makes is allowed there, and nothing elsewhere."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render({"operator": {"watchNamespaces": [namespace]}}, name="ns", namespace=namespace)
    rbac = [
        doc
        for text in (rendered["lockstep/templates/operator-rbac.yaml"],)
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] in ("ServiceAccount", "Role", "RoleBinding")
    ]
    assert {d["kind"] for d in rbac} == {"ServiceAccount", "Role", "RoleBinding"}
    for doc in rbac:
        kubectl.apply(doc, namespace)
    user = f"system:serviceaccount:{namespace}:ns-lockstep-operator"

    def can(verb: str, resource: str, where: str = namespace) -> bool:
        resource, _, sub = resource.partition("/")
        extra = [f"--subresource={sub}"] if sub else []
        result = kubectl.run("auth", "can-i", verb, resource, *extra, "-n", where, "--as", user, check=False)
        return result.stdout.strip() == "yes"

    calls = [
        ("get", "llmservices.serving.lockstep.dev"), ("list", "llmservices.serving.lockstep.dev"),
        ("watch", "llmservices.serving.lockstep.dev"), ("patch", "llmservices.serving.lockstep.dev/status"),
        ("patch", "statefulsets.apps"), ("delete", "statefulsets.apps"), ("list", "statefulsets.apps"),
        ("patch", "services"), ("patch", "configmaps"), ("patch", "networkpolicies.networking.k8s.io"),
        ("delete", "networkpolicies.networking.k8s.io"), ("list", "pods"), ("delete", "pods"),
        ("create", "secrets"), ("list", "events"), ("create", "events"),
        ("list", "poddisruptionbudgets.policy"), ("patch", "poddisruptionbudgets.policy"),
        ("delete", "poddisruptionbudgets.policy"),
    ]  # fmt: skip
    assert [call for call in calls if not can(*call)] == []
    assert not can("get", "secrets") and not can("list", "secrets")  # the operator reads no Secret
    assert not can("patch", "llmservices.serving.lockstep.dev")  # never the spec
    assert not can("list", "statefulsets.apps", "default")  # nothing outside its namespace
