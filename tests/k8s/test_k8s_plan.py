"""The reconcile plan: scaling, group restarts, group-by-group rollouts and level-based status.

A small in-memory world stands in for the API server and the StatefulSet controller: it stores
what a plan applies and makes one pod per rank slot from the StatefulSet's current template.
"""

from __future__ import annotations

import copy
import itertools

from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import (
    ANNOTATION_APPLIED_GENERATION,
    ANNOTATION_MEMBERS,
    ANNOTATION_RESTARTS,
    LABEL_GROUP,
    LABEL_POD_INDEX,
)
from lockstep_operator.conditions import status_changed
from lockstep_operator.plan import Observed, Plan, plan_reconcile

CONFIG = OperatorConfig(engine_image="registry.example/lockstep:9.9.9")
NOW = "2026-11-29T12:00:00Z"
LATER = "2026-11-29T12:05:00Z"
_uids = (f"uid-{n}" for n in itertools.count())


class World:
    def __init__(self, spec: dict) -> None:
        self.owner = {
            "metadata": {"name": "llama", "namespace": "prod", "uid": "owner-uid", "generation": 1},
            "spec": spec,
        }
        self.objects: dict[tuple[str, str], dict] = {}
        self.pods: dict[str, dict] = {}
        self.events: list[dict] = []

    def observed(self) -> Observed:
        kinds = {"StatefulSet": [], "Service": [], "ConfigMap": [], "NetworkPolicy": [], "Secret": [], "PodDisruptionBudget": []}
        for (kind, _), obj in sorted(self.objects.items()):
            kinds[kind].append(copy.deepcopy(obj))
        return Observed(
            statefulsets=kinds["StatefulSet"],
            services=kinds["Service"],
            configmaps=kinds["ConfigMap"],
            networkpolicies=kinds["NetworkPolicy"],
            disruptionbudgets=kinds["PodDisruptionBudget"],
            pods=[copy.deepcopy(p) for p in self.pods.values()],
            events=copy.deepcopy(self.events),
        )

    def plan(self, now: str = NOW) -> Plan:
        return plan_reconcile(copy.deepcopy(self.owner), self.observed(), CONFIG, now)

    def execute(self, plan: Plan) -> None:
        for obj in plan.create:
            self.objects.setdefault((obj["kind"], obj["metadata"]["name"]), copy.deepcopy(obj))
        for obj in plan.apply:
            key = (obj["kind"], obj["metadata"]["name"])
            stored = copy.deepcopy(obj)
            old = self.objects.get(key)
            stored["metadata"]["uid"] = old["metadata"]["uid"] if old else next(_uids)
            if old:  # annotations written by merge patches survive an apply that does not own them
                stored["metadata"]["annotations"] = {
                    **old["metadata"].get("annotations", {}),
                    **stored["metadata"]["annotations"],
                }
            if obj["kind"] == "StatefulSet":  # the API server counts spec changes; Kube.apply records it
                generation = old["metadata"]["generation"] if old else 0
                if not old or old["spec"] != stored["spec"]:
                    generation += 1
                stored["metadata"]["generation"] = generation
                stored["metadata"]["annotations"][ANNOTATION_APPLIED_GENERATION] = str(generation)
            self.objects[key] = stored
        for kind, name in plan.delete:
            self.objects.pop((kind, name))
            if kind == "StatefulSet":
                self.pods = {n: p for n, p in self.pods.items() if not n.startswith(name + "-")}
        for name, uid in plan.delete_pods:
            if self.pods.get(name, {}).get("metadata", {}).get("uid") == uid:
                del self.pods[name]
        for name, marks in plan.annotate:
            self.objects[("StatefulSet", name)]["metadata"].setdefault("annotations", {}).update(marks)
        if plan.status:
            self.owner["status"] = plan.status

    def run_statefulset_controller(self) -> None:
        for (kind, name), sts in self.objects.items():
            if kind != "StatefulSet":
                continue
            for ordinal in range(sts["spec"]["replicas"]):
                pod_name = f"{name}-{ordinal}"
                if pod_name not in self.pods:
                    template = copy.deepcopy(sts["spec"]["template"])
                    labels = {**template["metadata"]["labels"], LABEL_POD_INDEX: str(ordinal)}
                    self.pods[pod_name] = {
                        "metadata": {"name": pod_name, "uid": next(_uids), "labels": labels},
                        "spec": template["spec"],
                        "status": {"phase": "Pending"},
                    }

    def set_ready(self, group: int | None = None) -> None:
        for pod in self.pods.values():
            if group is None or pod["metadata"]["labels"][LABEL_GROUP] == str(group):
                pod["status"] = {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [{"name": "engine", "restartCount": 0, "ready": True}],
                }

    def settle(self, rounds: int = 4) -> Plan:
        """Reconcile until nothing is left to do (as the real operator does on events)."""
        plan = self.plan()
        for _ in range(rounds):
            self.execute(plan)
            self.run_statefulset_controller()
            plan = self.plan()
            if not (plan.apply or plan.delete or plan.delete_pods or plan.annotate):
                break
        self.execute(plan)
        return plan

    def pod_uids(self, group: int) -> set[str]:
        return {p["metadata"]["uid"] for n, p in self.pods.items() if n.startswith(f"llama-g{group}-")}

    def condition(self, type_: str) -> dict:
        return next(c for c in self.owner["status"]["conditions"] if c["type"] == type_)


def ready_world(replicas: int = 2, tensor: int = 2) -> World:
    world = World(
        {
            "model": {"source": "smollm2"},
            "parallelism": {"tensor": tensor, "gpusPerPod": 1},
            "replicas": replicas,
        }
    )
    world.settle()
    world.set_ready()
    world.settle()
    return world


def test_a_new_service_gets_its_objects_and_starts_unready():
    world = World(
        {"model": {"source": "smollm2"}, "parallelism": {"tensor": 2, "gpusPerPod": 1}, "replicas": 2}
    )
    plan = world.plan()
    assert [(o["kind"], o["metadata"]["name"]) for o in plan.apply] == [
        ("ConfigMap", "llama-engine"), ("Service", "llama"), ("NetworkPolicy", "llama"),
        ("PodDisruptionBudget", "llama"),
        ("Service", "llama-g0"), ("NetworkPolicy", "llama-g0"), ("StatefulSet", "llama-g0"),
        ("Service", "llama-g1"), ("NetworkPolicy", "llama-g1"), ("StatefulSet", "llama-g1"),
    ]  # fmt: skip
    assert [(o["kind"], o["metadata"]["name"]) for o in plan.create] == [("Secret", "llama-group-secret")]
    assert [(t, r) for t, r, _ in plan.events] == [("Normal", "GroupCreate")] * 2
    assert plan.events[1][2].startswith("creating group 1 (2 pods, revision ")
    assert plan.status["podsPerGroup"] == 2
    assert plan.status["conditions"][0]["status"] == "False"
    world.settle()
    assert len(world.pods) == 4
    assert world.owner["status"]["readyReplicas"] == 0
    assert world.condition("Progressing")["reason"] == "GroupsStarting"


def test_ready_pods_make_the_service_ready_with_counts_and_generation():
    world = ready_world()
    status = world.owner["status"]
    assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
    assert status["observedGeneration"] == 1
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "Ready": ("True", "AllGroupsReady"),
        "Available": ("True", "GroupsAvailable"),
        "Progressing": ("False", "Complete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert all(c["observedGeneration"] == 1 for c in status["conditions"])
    assert [g["state"] for g in status["groups"]] == ["Ready", "Ready"]


def test_a_settled_service_needs_no_writes():
    world = ready_world()
    plan = world.plan(LATER)
    assert not (plan.apply or plan.delete or plan.delete_pods or plan.annotate)
    assert not status_changed(world.owner["status"], plan.status)
    # Transition times stay when nothing changed.
    assert plan.status["conditions"] == world.owner["status"]["conditions"]


def test_complete_groups_record_their_members():
    world = ready_world()
    sts = world.objects[("StatefulSet", "llama-g1")]
    assert set(sts["metadata"]["annotations"][ANNOTATION_MEMBERS].split(",")) == world.pod_uids(1)


def test_a_statefulset_changed_by_someone_else_is_applied_again_without_touching_pods():
    world = ready_world()
    sts = world.objects[("StatefulSet", "llama-g0")]
    sts["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    sts["metadata"]["generation"] += 1
    plan = world.plan()
    assert [(o["kind"], o["metadata"]["name"]) for o in plan.apply] == [("StatefulSet", "llama-g0")]
    assert not plan.delete_pods
    world.settle()
    assert (
        world.objects[("StatefulSet", "llama-g0")]["spec"]["template"]["spec"]["containers"][0]["image"]
        == CONFIG.engine_image
    )


def test_a_restarted_container_restarts_its_whole_group_only():
    world = ready_world()
    before_g0, before_g1 = world.pod_uids(0), world.pod_uids(1)
    world.pods["llama-g1-1"]["status"]["containerStatuses"][0]["restartCount"] = 1
    plan = world.plan()
    assert sorted(name for name, _ in plan.delete_pods) == ["llama-g1-0", "llama-g1-1"]
    assert plan.group_restarts == 1
    assert ("Warning", "GroupRestart", "restarting group 1: pod llama-g1-1 restarted") in plan.events
    world.execute(plan)
    assert world.condition("Degraded")["reason"] == "GroupRestarting"
    assert world.owner["status"]["groups"][1]["state"] == "Restarting"
    world.run_statefulset_controller()
    world.settle()
    assert world.pod_uids(0) == before_g0
    assert not world.pod_uids(1) & before_g1
    assert world.objects[("StatefulSet", "llama-g1")]["metadata"]["annotations"][ANNOTATION_RESTARTS] == "1"
    world.set_ready(1)
    world.settle()
    assert world.condition("Ready")["status"] == "True"
    assert world.owner["status"]["groups"][1]["restarts"] == 1


def test_a_deleted_member_restarts_its_group():
    world = ready_world()
    del world.pods["llama-g0-1"]
    plan = world.plan()
    assert [name for name, _ in plan.delete_pods] == ["llama-g0-0"]
    assert "1 of its pods was deleted" in plan.events[0][2]


def test_a_replaced_member_restarts_its_group():
    world = ready_world()
    del world.pods["llama-g0-1"]
    world.run_statefulset_controller()  # the StatefulSet made the replacement before we looked
    plan = world.plan()
    assert sorted(name for name, _ in plan.delete_pods) == ["llama-g0-0", "llama-g0-1"]
    assert "pod llama-g0-1 was replaced" in plan.events[0][2]


def test_a_failed_pod_restarts_its_group():
    world = ready_world()
    world.pods["llama-g1-0"]["status"]["phase"] = "Failed"
    assert "pod llama-g1-0 failed" in world.plan().events[0][2]


def test_scaling_up_creates_groups_and_touches_no_pods():
    world = ready_world(replicas=2)
    before = dict(world.pods)
    world.owner["spec"]["replicas"] = 3
    plan = world.plan()
    assert [(o["kind"], o["metadata"]["name"]) for o in plan.apply] == [
        ("Service", "llama-g2"),
        ("NetworkPolicy", "llama-g2"),
        ("StatefulSet", "llama-g2"),
    ]
    assert not plan.delete_pods
    world.settle()
    assert all(world.pods[n]["metadata"]["uid"] == p["metadata"]["uid"] for n, p in before.items())
    assert world.condition("Ready")["status"] == "False"
    world.set_ready(2)
    world.settle()
    assert world.owner["status"]["readyReplicas"] == 3


def test_scaling_down_deletes_the_highest_groups():
    world = ready_world(replicas=3)
    world.owner["spec"]["replicas"] = 1
    plan = world.plan()
    assert plan.delete == [
        ("StatefulSet", "llama-g2"),
        ("StatefulSet", "llama-g1"),
        ("Service", "llama-g1"),
        ("Service", "llama-g2"),
        ("NetworkPolicy", "llama-g1"),
        ("NetworkPolicy", "llama-g2"),
    ]
    assert not plan.delete_pods
    world.settle()
    assert world.condition("Ready")["status"] == "True"


def test_scaling_to_zero_is_ready_but_unavailable():
    world = ready_world(replicas=1)
    world.owner["spec"]["replicas"] = 0
    world.settle()
    world.settle()
    assert not world.pods
    assert world.condition("Ready")["reason"] == "ScaledToZero"
    assert world.condition("Available")["status"] == "False"


def test_a_spec_change_with_max_unavailable_1_and_no_surge_rolls_one_group_at_a_time():
    world = ready_world(replicas=3)
    world.owner["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 1}
    world.owner["spec"]["decode"] = {"numSchedulerSteps": 4}
    world.owner["metadata"]["generation"] = 2

    plan = world.plan()
    assert sorted(name for name, _ in plan.delete_pods) == ["llama-g0-0", "llama-g0-1"]
    world.settle()
    assert steps_of(world) == {"llama-g0": "4", "llama-g1": "8", "llama-g2": "8"}
    assert world.owner["status"]["updatedReplicas"] == 1
    assert world.condition("Progressing")["reason"] == "RollingUpdate"
    assert world.condition("Available")["status"] == "True"
    assert world.owner["status"]["observedGeneration"] == 2

    world.set_ready(0)
    world.settle()
    assert steps_of(world) == {"llama-g0": "4", "llama-g1": "4", "llama-g2": "8"}
    world.set_ready(1)
    world.settle()
    assert steps_of(world) == {"llama-g0": "4", "llama-g1": "4", "llama-g2": "4"}
    world.set_ready(2)
    world.settle()
    assert world.condition("Ready")["status"] == "True"
    assert world.owner["status"]["updatedReplicas"] == 3


def test_an_unavailable_outdated_group_is_replaced_at_once():
    world = ready_world(replicas=2)
    world.pods["llama-g1-0"]["status"]["conditions"][0]["status"] = "False"
    world.owner["spec"]["decode"] = {"numSchedulerSteps": 2}
    plan = world.plan()
    replaced = {name.rsplit("-", 1)[0] for name, _ in plan.delete_pods}
    # g1 is down anyway; g0 waits because another group is unavailable.
    assert replaced == {"llama-g1"}


def test_pods_from_the_old_template_under_an_updated_statefulset_are_replaced():
    world = ready_world(replicas=1)
    world.owner["spec"]["decode"] = {"numSchedulerSteps": 2}
    world.execute(world.plan())
    old_template = copy.deepcopy(world.pods)
    world.run_statefulset_controller()
    # The StatefulSet controller raced the update and made a pod from the previous revision.
    world.pods["llama-g0-0"]["metadata"]["labels"] = old_template.get("llama-g0-0", world.pods["llama-g0-1"])[
        "metadata"
    ]["labels"] | {"serving.lockstep.dev/revision": "stale"}
    plan = world.plan()
    assert sorted(name for name, _ in plan.delete_pods) == ["llama-g0-0", "llama-g0-1"]
    assert plan.status["groups"][0]["state"] == "Updating"


def test_an_invalid_spec_changes_nothing_and_says_why():
    world = ready_world(replicas=1)
    world.owner["spec"]["parallelism"] = {"tensor": 3, "gpusPerPod": 2}
    world.owner["metadata"]["generation"] = 2
    plan = world.plan()
    assert not (plan.apply or plan.delete or plan.delete_pods or plan.annotate)
    world.execute(plan)
    ready = world.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "tensor * pipeline (3) must be divisible by gpusPerPod (2)" in ready["message"]
    assert world.owner["status"]["observedGeneration"] == 2


def test_the_plan_never_writes_the_llmservice_spec():
    world = ready_world(replicas=2)
    world.owner["spec"]["replicas"] = 3
    plan = world.plan()
    assert {o["kind"] for o in plan.apply} <= {"ConfigMap", "Service", "StatefulSet", "NetworkPolicy"}
    assert set(plan.status) == {
        "observedGeneration", "replicas", "readyReplicas", "updatedReplicas", "selector",
        "podsPerGroup", "steps", "conditions", "groups",
    }  # fmt: skip


QUOTA_MESSAGE = (
    'create Pod llama-g0-1 in StatefulSet llama-g0 failed error: pods "llama-g0-1" is forbidden: '
    "exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=1, "
    "limited: requests.nvidia.com/gpu=1"
)


def failed_create(world: World, group: int, message: str, at: str) -> dict:
    sts = world.objects[("StatefulSet", f"llama-g{group}")]
    return {
        "type": "Warning",
        "reason": "FailedCreate",
        "message": message,
        "lastTimestamp": at,
        "involvedObject": {"kind": "StatefulSet", "name": f"llama-g{group}", "uid": sts["metadata"]["uid"]},
    }


def test_a_pod_the_api_server_refused_puts_the_reason_in_status():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"tensor": 2, "gpusPerPod": 1}})
    world.execute(world.plan())
    world.run_statefulset_controller()
    del world.pods["llama-g0-1"]  # the quota admitted one pod of two
    world.events = [
        failed_create(world, 0, "an older refusal", "2026-11-29T11:00:00Z"),
        failed_create(world, 0, QUOTA_MESSAGE, "2026-11-29T11:59:00Z"),
    ]
    plan = world.plan()
    world.execute(plan)
    ready, degraded = world.condition("Ready"), world.condition("Degraded")
    assert (ready["status"], ready["reason"]) == ("False", "FailedCreate")
    assert "exceeded quota: gpus" in ready["message"] and "0 of 1 groups ready" in ready["message"]
    assert (degraded["status"], degraded["reason"]) == ("True", "FailedCreate")
    assert degraded["message"] == f"group 0: {QUOTA_MESSAGE}"
    assert world.owner["status"]["groups"][0]["message"] == QUOTA_MESSAGE


def test_refusals_of_a_complete_group_or_of_another_statefulset_are_ignored():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"tensor": 2, "gpusPerPod": 1}})
    world.settle()
    world.events = [failed_create(world, 0, QUOTA_MESSAGE, "2026-11-29T11:59:00Z")]
    world.events.append({**world.events[0], "involvedObject": {"kind": "StatefulSet", "uid": "someone-else"}})
    world.execute(world.plan())
    assert world.condition("Degraded")["reason"] == "AsExpected"
    assert "message" not in world.owner["status"]["groups"][0]


def test_an_unschedulable_pod_says_what_the_scheduler_said():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"tensor": 2, "gpusPerPod": 1}})
    world.settle()
    world.pods["llama-g0-1"]["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    world.execute(world.plan())
    ready = world.condition("Ready")
    assert ready["reason"] == "Unschedulable"
    assert "pod llama-g0-1: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in ready["message"]


def test_an_image_that_cannot_be_pulled_says_so():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"gpusPerPod": 1}})
    world.settle()
    world.pods["llama-g0-0"]["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "engine",
                "restartCount": 0,
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'}},
            }
        ],
    }
    world.execute(world.plan())
    degraded = world.condition("Degraded")
    assert degraded["reason"] == "ImagePullBackOff"
    assert degraded["message"] == 'group 0: pod llama-g0-0 container engine: ImagePullBackOff: Back-off pulling image "x:1"'


def test_turning_network_policies_off_deletes_them():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"gpusPerPod": 1}, "replicas": 2})
    world.settle()
    config = OperatorConfig(engine_image=CONFIG.engine_image, network_policy=False)
    plan = plan_reconcile(copy.deepcopy(world.owner), world.observed(), config, NOW)
    assert sorted(name for kind, name in plan.delete if kind == "NetworkPolicy") == ["llama", "llama-g0", "llama-g1"]
    assert not any(o["kind"] == "NetworkPolicy" for o in plan.apply)


# --- crash loops: back-off between group restarts, the engine's last error in status ---------------

TRACEBACK = """launch.py: starting 2 ranks
Traceback (most recent call last):
  File "/opt/lockstep/venv/lib/python3.11/site-packages/lockstep_engine/group/rendezvous.py", line 246
lockstep_engine.group.rendezvous.GroupError: tensor_parallel_size=2 does not divide the model's 9 attention heads
launch.py: rank process 17 exited with 1; stopping the pod's other ranks
"""
ERROR = "lockstep_engine.group.rendezvous.GroupError: tensor_parallel_size=2 does not divide the model's 9 attention heads"


def crash(world: World, pod: str, message: str = TRACEBACK) -> None:
    """What the kubelet reports after the engine exited: the restart, the log's tail as termination message."""
    world.pods[pod]["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [{
            "name": "engine", "restartCount": 1, "ready": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
        }],
    }  # fmt: skip


def at(seconds: int) -> str:
    return f"2026-11-29T12:{seconds // 60:02d}:{seconds % 60:02d}Z"


def test_the_last_error_line_is_the_exception_not_the_launchers_note():
    from lockstep_operator.groups import error_line

    assert error_line(TRACEBACK) == ERROR
    assert error_line("loading\nlockstep serve: error: argument --max-model-len: invalid int\n") == (
        "lockstep serve: error: argument --max-model-len: invalid int"
    )
    assert error_line("only this\n") == "only this"
    assert error_line("") == ""


def test_the_error_line_comes_from_before_the_launchers_note_not_from_the_ranks_it_stopped():
    # The pod log of a TP=2 SmolLM2 group (seen in e2e): the worker rank refuses the layout first, the
    # launcher stops the leader while it loads, and the leader's last words are about draining.
    from lockstep_operator.groups import error_line

    log = """[lockstep] serving 'smollm2' as ['smollm2'] on http://0.0.0.0:8000 (num_scheduler_steps=8)
[lockstep] resolved model 'smollm2' in 3.7s (135M parameters)
[lockstep] error: rank 1: tensor_parallel_size=2 does not divide the model's 9 attention heads (expected one of 1, 3); exiting
launch.py: rank process 31 exited with 1; stopping the pod's other ranks
[lockstep] SIGTERM: shutting down
[lockstep] draining: 0 request(s) in flight, grace period 30 s
"""
    assert error_line(log) == ("[lockstep] error: rank 1: tensor_parallel_size=2 does not divide the model's 9 "
                               "attention heads (expected one of 1, 3); exiting")
    # with nothing before the note, what follows it is all there is
    assert error_line("launch.py: rank process 31 exited with 1; stopping the pod's other ranks\nKilled\n") == "Killed"


def test_a_group_failing_before_ready_backs_off_exponentially_and_says_why():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"tensor": 1}, "replicas": 1})
    world.settle()
    crash(world, "llama-g0-0")
    plan = world.plan(at(0))
    assert [name for name, _ in plan.delete_pods] == ["llama-g0-0"]  # the first restart is at once
    (event,) = [e for e in plan.events if e[1] == "GroupRestart"]
    assert event[2] == f"restarting group 0: pod llama-g0-0 restarted; last error: pod llama-g0-0 container engine exited with code 1: {ERROR}"
    world.execute(plan)
    assert world.condition("Degraded")["reason"] == "EngineFailed"
    assert ERROR in world.condition("Degraded")["message"]
    assert world.condition("Ready")["reason"] == "EngineFailed"

    restarts = [0]
    for failure, backoff in ((2, 15), (3, 30), (4, 60)):
        world.run_statefulset_controller()
        crash(world, "llama-g0-0")
        early = world.plan(at(restarts[-1] + backoff - 1))
        assert not early.delete_pods and early.requeue_after == 1
        world.execute(early)
        group = world.owner["status"]["groups"][0]
        assert group["state"] == "CrashLoopBackOff"
        times = "once" if failure == 2 else f"{failure - 1} times"
        assert group["message"] == (f"restarted {times} without becoming ready; last error: "
                                    f"pod llama-g0-0 container engine exited with code 1: {ERROR}; next restart in 1 s")  # fmt: skip
        degraded = world.condition("Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoopBackOff")
        assert world.condition("Ready")["reason"] == "CrashLoopBackOff"
        due = world.plan(at(restarts[-1] + backoff))
        assert [name for name, _ in due.delete_pods] == ["llama-g0-0"]
        world.execute(due)
        restarts.append(restarts[-1] + backoff)
    sts = world.objects[("StatefulSet", "llama-g0")]["metadata"]["annotations"]
    assert sts[ANNOTATION_RESTARTS] == "4"


def test_a_group_that_became_ready_restarts_at_once_on_its_next_failure():
    world = World({"model": {"source": "smollm2"}, "parallelism": {"tensor": 1}, "replicas": 1})
    world.settle()
    for second in (0, 15):
        world.run_statefulset_controller()
        crash(world, "llama-g0-0")
        world.execute(world.plan(at(second)))
    world.run_statefulset_controller()
    world.set_ready()
    world.execute(world.plan(at(20)))
    assert world.condition("Degraded")["reason"] == "AsExpected"
    crash(world, "llama-g0-0")
    assert [name for name, _ in world.plan(at(21)).delete_pods] == ["llama-g0-0"]


def steps_of(world: World) -> dict[str, str]:
    result = {}
    for (kind, name), sts in world.objects.items():
        if kind == "StatefulSet":
            args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
            result[name] = args[args.index("--num-scheduler-steps") + 1]
    return result


def ready_groups(world: World) -> int:
    return world.owner["status"]["readyReplicas"]


def test_a_spec_change_of_one_group_starts_a_surge_group_before_the_old_one_goes():
    world = ready_world(replicas=1)
    world.owner["spec"]["decode"] = {"numSchedulerSteps": 4}
    world.owner["metadata"]["generation"] = 2
    plan = world.plan()
    assert not plan.delete_pods  # the only group keeps serving
    assert [o["metadata"]["name"] for o in plan.apply if o["kind"] == "StatefulSet"] == ["llama-g1"]
    world.settle()
    assert steps_of(world) == {"llama-g0": "8", "llama-g1": "4"}
    assert world.owner["status"]["groups"][1] == {**world.owner["status"]["groups"][1], "surge": True, "state": "Starting"}
    assert world.condition("Available")["status"] == "True"
    assert world.condition("Progressing")["reason"] == "RollingUpdate"
    world.set_ready(1)  # the surge group is ready: now the old one is replaced
    world.settle()
    assert steps_of(world) == {"llama-g0": "4", "llama-g1": "4"}
    assert ready_groups(world) == 1  # the surge group serves while group 0 restarts
    world.set_ready(0)
    world.settle()
    assert steps_of(world) == {"llama-g0": "4"}  # the surge group is gone
    assert world.condition("Ready")["status"] == "True"
    assert world.condition("Progressing")["reason"] == "Complete"
    assert world.owner["status"]["replicas"] == 1 and world.owner["status"]["updatedReplicas"] == 1


def test_at_no_point_of_a_default_rollout_is_a_group_less_ready():
    world = ready_world(replicas=2)
    world.owner["spec"]["decode"] = {"numSchedulerSteps": 4}
    for _ in range(8):
        world.settle()
        assert ready_groups(world) >= 2, world.owner["status"]["groups"]
        world.set_ready()  # every pod that exists becomes ready
    world.settle()
    assert steps_of(world) == {"llama-g0": "4", "llama-g1": "4"}
    assert world.condition("Ready")["status"] == "True"


def test_a_failing_surge_group_leaves_the_old_groups_serving():
    world = ready_world(replicas=1)
    world.owner["spec"]["engine"] = {"image": "registry.example/lockstep:broken"}
    for _ in range(3):
        world.settle()
    assert steps_of(world) == {"llama-g0": "8", "llama-g1": "8"}
    assert world.pod_uids(0) and ready_groups(world) == 1
    assert world.objects[("StatefulSet", "llama-g0")]["spec"]["template"]["spec"]["containers"][0]["image"] != (
        "registry.example/lockstep:broken"
    )


def test_scaling_down_removes_a_group_that_no_rollout_started():
    world = ready_world(replicas=2)
    world.owner["spec"]["replicas"] = 1
    world.pods["llama-g0-0"]["status"]["conditions"][0]["status"] = "False"  # group 0 not ready
    assert ("StatefulSet", "llama-g1") in world.plan().delete


def test_rollout_values_are_checked_and_percentages_resolve_as_a_deployments():
    import pytest

    from lockstep_operator.spec import SpecError, parse_spec

    def rollout(replicas, **values):
        spec = parse_spec("x", {"model": {"source": "smollm2"}, "replicas": replicas, "rollout": values},
                          default_image="i:1")  # fmt: skip
        return spec.max_surge, spec.max_unavailable

    assert rollout(4) == (1, 0)
    assert rollout(4, maxSurge="25%", maxUnavailable="25%") == (1, 1)
    assert rollout(3, maxSurge="50%", maxUnavailable="50%") == (2, 1)
    assert rollout(1, maxSurge="0%", maxUnavailable="10%") == (0, 1)  # rounds to nothing: one at a time
    with pytest.raises(SpecError, match="spec.rollout: maxSurge and maxUnavailable cannot both be 0"):
        rollout(2, maxSurge=0)
    with pytest.raises(SpecError, match=r"spec.rollout.maxSurge: must be an integer in 0..1024 or a percentage"):
        rollout(2, maxSurge="two")


# --- spec.autoscaling: the decision from demand ------------------------------------------------------

def test_autoscaling_adds_groups_for_the_waiting_excess_and_starts_from_zero_on_a_queued_request():
    from lockstep_operator.autoscale import Autoscaling, Demand, desired_replicas

    policy = Autoscaling(min_replicas=0, max_replicas=4, target_waiting_per_group=2, scale_down_delay_seconds=60)
    assert desired_replicas(0, Demand(queued=1), policy, None, NOW)[0] == 1  # the first request at zero
    assert desired_replicas(1, Demand(waiting=2, running=8), policy, None, NOW)[0] == 1  # at the target
    assert desired_replicas(1, Demand(waiting=7, running=8), policy, None, NOW)[0] == 4  # 1 + ceil(5 / 2)
    assert desired_replicas(2, Demand(waiting=30), policy, None, NOW)[0] == 4  # maxReplicas
    assert desired_replicas(0, Demand(), policy, None, NOW)[0] == 0


def test_autoscaling_removes_one_group_after_the_delay_without_a_break():
    from lockstep_operator.autoscale import Autoscaling, Demand, desired_replicas

    policy = Autoscaling(min_replicas=0, max_replicas=4, target_waiting_per_group=2, scale_down_delay_seconds=60)
    desired, status = desired_replicas(2, Demand(running=1), policy, None, at(0))  # fits in 1 group
    assert (desired, status["quietSince"]) == (2, at(0))
    desired, status = desired_replicas(2, Demand(running=2), policy, status, at(30))
    assert (desired, status["quietSince"]) == (2, at(0))
    desired, broken = desired_replicas(2, Demand(running=3), policy, status, at(40))  # no longer fits: a break
    assert desired == 2 and "quietSince" not in broken
    desired, status = desired_replicas(2, Demand(running=2), policy, status, at(60))
    assert (desired, status["lastScaleTime"]) == (1, at(60)) and "quietSince" not in status
    desired, status = desired_replicas(1, Demand(), policy, status, at(61))
    assert desired == 1 and status["quietSince"] == at(61)
    assert desired_replicas(1, Demand(), policy, status, at(121))[0] == 0  # idle for the delay: to zero
    floor = Autoscaling(min_replicas=1, max_replicas=4, target_waiting_per_group=2, scale_down_delay_seconds=0)
    assert desired_replicas(1, Demand(), floor, None, NOW)[0] == 1  # never below minReplicas


def test_gauges_are_summed_from_the_exposition_by_label():
    from lockstep_operator.autoscale import gauge_sum

    text = """# HELP vllm:num_requests_waiting Requests waiting
vllm:num_requests_waiting{model_name="smollm2"} 3.0
vllm:num_requests_waiting_total 99
lockstep_gateway_queue_depth{model="smollm2"} 2
lockstep_gateway_queue_depth{model="other"} 5
"""
    assert gauge_sum(text, "vllm:num_requests_waiting") == 3.0
    assert gauge_sum(text, "lockstep_gateway_queue_depth", {"model": "smollm2"}) == 2.0
    assert gauge_sum(text, "lockstep_gateway_queue_depth") == 7.0
    assert gauge_sum("", "vllm:num_requests_running") == 0.0


def test_autoscaling_values_are_checked():
    import pytest

    from lockstep_operator.spec import SpecError, parse_spec

    def parse(autoscaling):
        return parse_spec("x", {"model": {"source": "smollm2"}, "autoscaling": autoscaling}, default_image="i:1")

    assert parse({"maxReplicas": 3}).autoscaling.min_replicas == 1
    with pytest.raises(SpecError, match="spec.autoscaling.maxReplicas: is required"):
        parse({"minReplicas": 0})
    with pytest.raises(SpecError, match=r"spec.autoscaling.minReplicas: must be at most maxReplicas \(2\), got 3"):
        parse({"minReplicas": 3, "maxReplicas": 2})


def test_the_scale_down_delay_does_not_run_while_groups_start():
    from lockstep_operator.autoscale import Autoscaling, Demand, desired_replicas

    policy = Autoscaling(min_replicas=0, max_replicas=2, target_waiting_per_group=1, scale_down_delay_seconds=20)
    desired, status = desired_replicas(1, Demand(), policy, {"quietSince": at(0)}, at(30), settled=False)
    assert desired == 1 and "quietSince" not in status  # a group started from zero: its request is not visible yet
    assert desired_replicas(1, Demand(), policy, status, at(31))[1]["quietSince"] == at(31)
