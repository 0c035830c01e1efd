"""End to end on a real cluster: the chart by Helm, engines in pods, requests through the gateway.

The scenarios build on each other and run in file order (`make e2e` stops at the first failure).
Each prints one `SCENARIO <name>: PASS|FAIL` line.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from e2e_harness import (
    CHART,
    NAMESPACE,
    RELEASE,
    RELEASE_VALUES,
    Kubectl,
    llmservice,
    say,
    scenario,
    wait_for,
)

PROMPT = "What is the capital of France?"
READY_TIMEOUT = 900


def openai_client(port: int):
    from openai import OpenAI

    return OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=300,
    )


def ask(port: int, model: str, prompt: str = PROMPT, max_tokens: int = 16) -> str:
    reply = openai_client(port).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=max_tokens,
    )
    return reply.choices[0].message.content or ""


def status(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return kubectl.json("get", "llmservice", name, "-n", NAMESPACE).get("status") or {}


def wait_ready(kubectl: Kubectl, name: str, timeout: float = READY_TIMEOUT) -> None:
    kubectl.run("wait", "-n", NAMESPACE, f"llmservice/{name}", "--for=condition=Ready", f"--timeout={int(timeout)}s",
                timeout=timeout + 30)  # fmt: skip


def wait_two_ready_groups(kubectl: Kubectl, what: str = "2 ready groups") -> None:
    wait_for(what, lambda: status(kubectl, "smollm2").get("readyReplicas") == 2, timeout=READY_TIMEOUT, interval=3)


def scale_to_two_groups(kubectl: Kubectl) -> None:
    kubectl.run("scale", "-n", NAMESPACE, "llmservice/smollm2", "--replicas=2")
    wait_two_ready_groups(kubectl)


@pytest.fixture(scope="module")
def gateway_port(kubectl: Kubectl):
    with kubectl.port_forward(f"svc/{RELEASE}-gateway", 80) as port:
        yield port


def test_install_the_chart(kubectl: Kubectl, helm_config) -> None:
    with scenario("helm install"):
        kubectl.run("create", "namespace", NAMESPACE)
        helm_config.install(str(CHART), RELEASE, RELEASE_VALUES, wait="watcher", timeout=300)
        kubectl.run(
            "wait",
            "-n",
            NAMESPACE,
            "deploy",
            "--all",
            "--for=condition=Available",
            "--timeout=300s",
            timeout=330,
        )


def test_smollm2_becomes_ready(kubectl: Kubectl) -> None:
    with scenario("apply the smollm2 LLMService, kubectl wait for Ready"):
        kubectl.apply(llmservice("smollm2"))
        wait_ready(kubectl, "smollm2")
        say(f"status: {status(kubectl, 'smollm2').get('groups')}")


def test_the_gateway_answers_paris(gateway_port: int) -> None:
    with scenario("openai client through the gateway answers Paris"):
        answer = wait_for(
            "a first answer",
            lambda: ask(gateway_port, "smollm2"),
            timeout=120,
            interval=2,
        )
        say(f"answer: {answer!r}")
        assert "Paris" in answer


def leader_metrics(kubectl: Kubectl, pod: str) -> str:
    """The engine leader's /metrics, through the API server's pod proxy."""
    return kubectl.run("get", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}:8000/proxy/metrics").stdout


def generated_tokens(kubectl: Kubectl, pod: str) -> float:
    total = 0.0
    for line in leader_metrics(kubectl, pod).splitlines():
        if line.startswith("lockstep_generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_scale_to_two_groups_and_both_take_requests(kubectl: Kubectl, gateway_port: int) -> None:
    with scenario("scale to 2 groups, both take requests"):
        scale_to_two_groups(kubectl)
        leaders = ["smollm2-g0-0", "smollm2-g1-0"]
        before = {pod: generated_tokens(kubectl, pod) for pod in leaders}
        from concurrent.futures import ThreadPoolExecutor

        def served_by_both() -> bool:
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: ask(gateway_port, "smollm2", max_tokens=4), range(4)))
            assert all(answers), answers
            return all(generated_tokens(kubectl, pod) > before[pod] for pod in leaders)

        wait_for("requests on both groups", served_by_both, timeout=300, interval=0.5)
        say("both groups generated tokens: " + ", ".join(f"{p}: {generated_tokens(kubectl, p):.0f}" for p in leaders))


def container_id(kubectl: Kubectl, pod: str) -> str:
    statuses = kubectl.json("get", "pod", pod, "-n", NAMESPACE)["status"]["containerStatuses"]
    engine = next(s for s in statuses if s["name"] == "engine")
    return engine["containerID"].split("://", 1)[1]


def test_killed_engine_restarts_its_group(kubectl: Kubectl, gateway_port: int) -> None:
    import os
    import subprocess

    with scenario("kill an engine container: the group restarts, serves again, status counts it"):
        restarts_before = {g["index"]: g.get("restarts", 0) for g in status(kubectl, "smollm2")["groups"]}
        uid_before = kubectl.json("get", "pod", "smollm2-g1-0", "-n", NAMESPACE)["metadata"]["uid"]
        sock = os.environ["LOCKSTEP_E2E_CONTAINERD_SOCK"]
        subprocess.run(["ctr", "--address", sock, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL",
                        container_id(kubectl, "smollm2-g1-0")], check=True, timeout=30)  # fmt: skip

        def restarted() -> bool:
            groups = {g["index"]: g for g in status(kubectl, "smollm2").get("groups", [])}
            return groups[1].get("restarts", 0) > restarts_before[1]

        wait_for("status.groups[1].restarts to grow", restarted, timeout=300, interval=2)
        wait_two_ready_groups(kubectl, "2 ready groups again")
        uid_after = kubectl.json("get", "pod", "smollm2-g1-0", "-n", NAMESPACE)["metadata"]["uid"]
        say(f"group 1: pod {uid_before[:8]} -> {uid_after[:8]}, status {status(kubectl, 'smollm2')['groups']}")
        before = generated_tokens(kubectl, "smollm2-g1-0")
        wait_for("the restarted group to serve", lambda: ask(gateway_port, "smollm2", max_tokens=4)
                 and generated_tokens(kubectl, "smollm2-g1-0") > before, timeout=300, interval=0.5)  # fmt: skip
        kubectl.run("scale", "-n", NAMESPACE, "llmservice/smollm2", "--replicas=1")
        wait_for(
            "1 group",
            lambda: status(kubectl, "smollm2").get("replicas") == 1,
            timeout=120,
            interval=2,
        )


def test_tp3_in_one_pod_and_pp2_across_pods_match_tp1(kubectl: Kubectl, gateway_port: int) -> None:
    with scenario("TP=3 in one pod (three CPU ranks) and PP=2 across two pods give TP=1's greedy tokens"):
        # SmolLM2-135M has 9 attention heads (3 KV heads): TP=3 is the smallest tensor split it allows.
        kubectl.apply(llmservice("tp3", tensor=3, ranksPerPod=3))
        kubectl.apply(llmservice("pp2", pipeline=2))
        wait_ready(kubectl, "tp3")
        wait_ready(kubectl, "pp2")
        pods = kubectl.json(
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            "serving.lockstep.dev/service in (tp3,pp2)",
        )["items"]
        say("pods: " + ", ".join(p["metadata"]["name"] for p in pods))
        reference = ask(gateway_port, "smollm2", max_tokens=24)
        for name in ("tp3", "pp2"):
            answer = ask(gateway_port, name, max_tokens=24)
            say(f"{name}: {answer!r} (TP=1: {reference!r})")
            assert answer == reference, name


def test_spec_change_rolls_one_group_at_a_time(kubectl: Kubectl, gateway_port: int) -> None:
    import threading

    with scenario("a spec change rolls one group at a time with no failed request"):
        scale_to_two_groups(kubectl)
        failures: list[str] = []
        answered = [0]
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    ask(gateway_port, "smollm2", max_tokens=4)
                    answered[0] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    failures.append(repr(exc))

        worker = threading.Thread(target=load)
        worker.start()
        try:
            kubectl.run("patch", "-n", NAMESPACE, "llmservice/smollm2", "--type=merge",
                        "-p", '{"spec": {"decode": {"numSchedulerSteps": 4}}}')  # fmt: skip
            generation = kubectl.json("get", "llmservice", "smollm2", "-n", NAMESPACE)["metadata"]["generation"]
            most_down = [0]

            def rolled() -> bool:
                st = status(kubectl, "smollm2")
                down = sum(1 for g in st.get("groups", []) if not g.get("ready"))
                most_down[0] = max(most_down[0], down)
                assert down <= 1, f"{down} groups down at once: {st.get('groups')}"
                return (st.get("observedGeneration") == generation and st.get("updatedReplicas") == 2
                        and st.get("readyReplicas") == 2)  # fmt: skip

            wait_for("the rollout", rolled, timeout=2 * READY_TIMEOUT, interval=1)
        finally:
            stop.set()
            worker.join(timeout=300)
        say(f"rollout done: {answered[0]} requests answered, {len(failures)} failed, at most {most_down[0]} group down")
        assert not failures, failures[:3]
        assert answered[0] > 0


def meta_label(name: str) -> str:
    """A Kubernetes label as Prometheus' service discovery names it (`__meta_kubernetes_pod_label_<name>`)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered_pod_targets(kubectl: Kubectl) -> list[dict[str, Any]]:
    """What Prometheus' `kubernetes_sd_configs` (role: pod) discovers in the namespace, as file_sd groups:
    one target per container port of every running pod, with the pod's labels as meta labels. Debian's
    prometheus 2.42 is built without kubernetes_sd, so the test lists the pods and hands them over."""
    groups = []
    for pod in kubectl.json("get", "pods", "-n", NAMESPACE)["items"]:
        ip = pod["status"].get("podIP")
        if pod["status"].get("phase") != "Running" or not ip:
            continue
        labels = {meta_label(k): v for k, v in pod["metadata"].get("labels", {}).items()}
        labels |= {"__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": pod["metadata"]["name"]}
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels | {
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})  # fmt: skip
    return groups


def podmonitor_scrape_config(monitor: dict[str, Any], file_sd: str) -> dict[str, Any]:
    """The PodMonitor as Prometheus Operator translates it: keep pods whose labels match the selector and
    the named port, then the monitor's own relabelings."""
    spec = monitor["spec"]
    relabel: list[dict[str, Any]] = [
        {"source_labels": [meta_label(k)], "regex": v, "action": "keep"} for k, v in spec["selector"]["matchLabels"].items()
    ]
    for expr in spec["selector"].get("matchExpressions", []):
        action = {"In": "keep", "NotIn": "drop"}[expr["operator"]]
        relabel.append({"source_labels": [meta_label(expr["key"])], "regex": "|".join(expr["values"]), "action": action})
    endpoint = spec["podMetricsEndpoints"][0]
    relabel.append({"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"], "action": "keep"})
    relabel.append({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"})
    relabel += [{"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]} for r in endpoint.get("relabelings", [])]
    return {"job_name": "engines", "metrics_path": endpoint.get("path", "/metrics"),
            "file_sd_configs": [{"files": [file_sd]}], "relabel_configs": relabel}  # fmt: skip


def engine_pods(kubectl: Kubectl, index: str) -> list[str]:
    selector = f"app.kubernetes.io/name=lockstep-engine,apps.kubernetes.io/pod-index{index}"
    return sorted(p["metadata"]["name"] for p in kubectl.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"])


def test_prometheus_scrapes_leaders_not_workers(kubectl: Kubectl, helm_config, tmp_path) -> None:
    import json
    import shutil
    import socket
    import subprocess
    import urllib.parse
    import urllib.request

    import helm_python as helm
    import yaml

    with scenario("a real Prometheus scrapes leaders, not workers (the chart's PodMonitor)"):
        with helm.Chart.load(str(CHART)) as chart:
            rendered = helm_config.render(chart, {**RELEASE_VALUES, "monitoring": {"podMonitor": {"enabled": True}}},
                                          name=RELEASE, namespace=NAMESPACE)  # fmt: skip
        monitors = [d for file, text in rendered.items() if file.endswith(".yaml")
                    for d in yaml.safe_load_all(text) if d and d.get("kind") == "PodMonitor"]  # fmt: skip
        assert len(monitors) == 1, monitors
        leaders, workers = engine_pods(kubectl, "=0"), engine_pods(kubectl, "!=0")
        assert leaders and workers, (leaders, workers)
        discovered = discovered_pod_targets(kubectl)
        (tmp_path / "pods.json").write_text(json.dumps(discovered))
        config = {
            "global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
            "scrape_configs": [podmonitor_scrape_config(monitors[0], str(tmp_path / "pods.json"))],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(tmp_path / "prometheus.log", "wb") as log:
            process = subprocess.Popen(
                [shutil.which("prometheus") or "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        api = f"http://127.0.0.1:{port}/api/v1"
        try:

            def up_series() -> dict[str, dict[str, Any]]:
                """`up` per scraped pod, once every leader has one."""
                url = f"{api}/query?" + urllib.parse.urlencode({"query": 'up{job="engines"}'})
                with urllib.request.urlopen(url, timeout=5) as r:
                    result = json.load(r)["data"]["result"]
                series = {s["metric"]["pod"]: s for s in result}
                return series if set(leaders) <= set(series) else {}

            series = wait_for("an `up` series for every leader", up_series, timeout=120, interval=2)
            with urllib.request.urlopen(f"{api}/targets", timeout=5) as r:
                dropped = json.load(r)["data"]["droppedTargets"]
            dropped_pods = {t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in dropped}
            say("up: " + ", ".join(f"{p}={s['value'][1]} ({s['metric'].get('llmservice')})" for p, s in sorted(series.items()))
                + f"; dropped: {sorted(dropped_pods)}")  # fmt: skip
            assert sorted(series) == leaders, (sorted(series), leaders)
            assert all(s["value"][1] == "1" for s in series.values()), series
            assert all(s["metric"].get("llmservice") for s in series.values()), series
            # Prometheus itself saw the workers (they declare the http port too) and its relabelling dropped them.
            assert set(workers) <= dropped_pods, (workers, sorted(dropped_pods))
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_helm_test_passes(helm_config) -> None:
    with scenario("helm test"):
        # A failing test pod raises HelmReleaseError; the logs show what the pod checked.
        result = helm_config.test(RELEASE, timeout=300, logs=True)
        logs = str(result.get("logs", "") if isinstance(result, dict) else result)
        say(f"helm test logs: {logs.strip()[:400]!r}")
        assert "GET /health: 200" in logs, logs
        assert "smollm2" in logs, logs


def test_helm_uninstall_leaves_nothing_behind(kubectl: Kubectl, helm_config) -> None:
    with scenario("helm uninstall leaves nothing behind"):
        kubectl.run(
            "delete",
            "llmservices",
            "--all",
            "-n",
            NAMESPACE,
            "--wait=true",
            "--timeout=300s",
            timeout=330,
        )
        helm_config.uninstall(RELEASE, wait="watcher", timeout=300)

        def leftovers() -> list[str]:
            kinds = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,poddisruptionbudgets,pvc"
            names = kubectl.run("get", kinds, "-n", NAMESPACE, "-o", "name").stdout.split()
            names += kubectl.run("get", "clusterroles,clusterrolebindings", "-o", "name", "-l",
                                 f"app.kubernetes.io/instance={RELEASE}").stdout.split()  # fmt: skip
            ignore = {"configmap/kube-root-ca.crt", "serviceaccount/default"}
            return [n for n in names if n not in ignore]

        wait_for("an empty namespace", lambda: not leftovers(), timeout=300, interval=2)
