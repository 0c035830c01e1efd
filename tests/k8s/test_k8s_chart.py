"""The Helm chart, rendered and linted by Helm's Go SDK, manifests checked against Kubernetes 1.37 schemas."""

from __future__ import annotations

import json

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from k8s_harness import CHART, EXAMPLE, crd_schema
from lockstep_operator.config import OperatorConfig
from lockstep_operator.spec import parse_spec
from pod_security import pod_specs, violations

K8S_VERSION = "1.37.0"
# Kinds whose schemas come from CRDs, not from Kubernetes itself.
CRD_KINDS = {"LLMService", "ServiceMonitor", "PodMonitor"}


def render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="lockstep", namespace="lockstep-system")
    return [
        doc
        for path, text in manifests.items()
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def test_helm_lint_reports_no_warnings_or_errors():
    report = helm.lint(str(CHART), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [] and report["errors"] == []


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "example": {"enabled": True},
            "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        },
        {
            "operator": {"watchNamespaces": ["team-a", "team-b"]},
            "gateway": {"discoveryNamespaces": ["team-a", "team-b"]},
        },
        {"gateway": {"enabled": False}, "dashboards": {"enabled": False}},
        {"operator": {"clusterWide": True}, "networkPolicy": {"enabled": False}},
        {
            "engineApiKey": {"secretName": "engine-key", "key": "k"},
            "example": {"enabled": True},
            "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {}}]},
            "gateway": {"image": {"digest": "sha256:" + "a" * 64}},
        },
    ],
    ids=["defaults", "everything-on", "namespaced", "operator-only", "cluster-wide", "api-key-digest"],
)
def test_every_rendered_manifest_validates_against_kubernetes_schemas(values):
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_images_are_pinned_and_pods_run_as_non_root():
    for doc in render({"example": {"enabled": True}}):
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            for container in pod["containers"]:
                assert container["image"].endswith(":0.1.0"), container["image"]
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_operator_gets_the_engine_image_and_watches_what_it_is_allowed_to():
    docs = render({"operator": {"watchNamespaces": ["team-a"]}})
    operator = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-operator"
    )
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "operator"
    assert "--engine-image=ghcr.io/lockstep-dev/lockstep:0.1.0" in args
    assert "--namespace=team-a" in args
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "lockstep-operator"]
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a"]
    assert not [d for d in docs if d["kind"] == "ClusterRole"]


def test_operator_rbac_is_a_role_in_the_release_namespace_by_default():
    docs = render()
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "lockstep-operator"]
    assert role["metadata"]["namespace"] == "lockstep-system"
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-operator")
    assert "--namespace=lockstep-system" in operator["spec"]["template"]["spec"]["containers"][0]["args"]


def test_cluster_wide_is_an_opt_in_and_excludes_a_namespace_list():
    docs = render({"operator": {"clusterWide": True}})
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "lockstep-operator"]
    assert binding["subjects"][0]["namespace"] == "lockstep-system"
    assert not [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "lockstep-operator"]
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-operator")
    assert not [a for a in operator["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--namespace")]
    with pytest.raises(Exception, match="operator.watchNamespaces cannot be set together with operator.clusterWide"):
        render({"operator": {"clusterWide": True, "watchNamespaces": ["a"]}})


@pytest.mark.parametrize("values", [{}, {"operator": {"clusterWide": True}}], ids=["role", "cluster-role"])
def test_operator_rbac_is_least_privilege(values):
    (role,) = [d for d in render(values) if d["kind"] in ("Role", "ClusterRole") and d["metadata"]["name"] == "lockstep-operator"]
    verbs = {
        (rule["apiGroups"][0], resource): set(rule["verbs"])
        for rule in role["rules"]
        for resource in rule["resources"]
    }
    assert verbs[("serving.lockstep.dev", "llmservices")] == {"get", "list", "watch"}  # never writes the spec
    assert verbs[("serving.lockstep.dev", "llmservices/status")] == {"get", "patch", "update"}
    assert verbs[("", "pods")] == {"get", "list", "watch", "delete"}
    assert not any("*" in v for v in verbs.values())
    assert verbs[("", "secrets")] == {"create"}  # the group Secret; the operator reads no Secret
    assert verbs[("", "events")] == {"list", "create", "patch"}
    assert verbs[("networking.k8s.io", "networkpolicies")] == {"get", "list", "watch", "create", "patch", "delete"}


def test_selectors_hold_only_chart_owned_labels():
    for doc in render({"commonLabels": {"team": "x"}, "operator": {"podLabels": {"a": "b"}}}):
        if doc["kind"] == "Deployment":
            assert set(doc["spec"]["selector"]["matchLabels"]) == {
                "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
            }  # fmt: skip
            assert doc["spec"]["template"]["metadata"]["labels"]["team"] == "x"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"operator": {"image": {"tag": "latest"}}},
            "at '/operator/image/tag': 'latest' does not match pattern '^(pin a version instead of latest)$'",
        ),
        ({"gateway": {"replicas": -1}}, "at '/gateway/replicas': minimum: got -1, want 0"),
        ({"operator": {"logLevel": "LOUD"}}, "at '/operator/logLevel'"),
        ({"operatr": {"enabled": True}}, "additional properties 'operatr' not allowed"),
        (
            {"gateway": {"service": {"port": 70000}}},
            "at '/gateway/service/port': maximum: got 70,000, want 65,535",
        ),
    ],
    ids=["latest-tag", "negative-replicas", "log-level", "typo", "port"],
)
def test_values_schema_rejects_bad_values_with_a_clear_message(values, message):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert message in str(caught.value)


def test_every_values_key_is_in_the_schema_and_commented():
    """A key is documented by a `# --` comment above it, or is a block whose keys all are."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    checked = []

    def walk(node: yaml.MappingNode, schema_node: dict, path: str) -> None:
        for key_node, value_node in node.value:
            key = f"{path}{key_node.value}"
            child = schema_node.get("properties", {}).get(key_node.value)
            assert child is not None, f"{key} is missing from values.schema.json"
            commented = lines[key_node.start_mark.line - 1].strip().startswith("# -- ")
            if not commented and isinstance(value_node, yaml.MappingNode) and child.get("properties"):
                walk(value_node, child, key + ".")
                continue
            assert commented, f"values.yaml: {key} has no '# --' comment above it"
            checked.append(key)

    walk(yaml.compose(text), schema, "")
    assert "operator.image.tag" in checked and "example.spec" in checked


def test_example_llmservice_is_valid_for_the_operator_and_in_the_chart():
    example = yaml.safe_load(EXAMPLE.read_text())
    spec = parse_spec(
        example["metadata"]["name"], example["spec"], default_image=OperatorConfig().engine_image
    )
    assert (spec.tensor, spec.pods_per_group, spec.steps) == (1, 1, "8")
    # SmolLM2-135M's 9 attention heads and 3 KV heads: the engine refuses a split that divides neither.
    assert 9 % spec.tensor == 0 and 3 % spec.tensor == 0
    (rendered,) = [d for d in render({"example": {"enabled": True}}) if d["kind"] == "LLMService"]
    assert rendered["apiVersion"] == "serving.lockstep.dev/v1alpha1"


def test_the_dashboard_parses_and_shows_step_gap_next_to_latency():
    (configmap,) = [
        d for d in render() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lockstep-dashboard"
    ]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["lockstep.json"])
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    for metric in (
        "lockstep_step_gap_seconds_bucket",
        "lockstep_gpu_idle_seconds_total",
        "lockstep_operator_reconciles_total",
        "vllm:kv_cache_usage_perc",
    ):
        assert metric in exprs


def test_the_crd_has_printer_columns_and_both_subresources():
    crd = yaml.safe_load((CHART / "crds" / "llmservices.serving.lockstep.dev.yaml").read_text())
    version = crd["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready",
        "Replicas",
        "Available",
        "Steps",
        "TP",
        "PP",
        "Model",
        "Age",
    ]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas", "labelSelectorPath": ".status.selector",
    }  # fmt: skip
    assert "status" in version["subresources"]
    assert (
        crd_schema()["properties"]["spec"]["properties"]["decode"]["properties"]["numSchedulerSteps"][
            "maximum"
        ]
        == 64
    )


def test_the_crd_itself_validates_against_kubernetes_schemas():
    crd = yaml.safe_load((CHART / "crds" / "llmservices.serving.lockstep.dev.yaml").read_text())
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def test_notes_tell_how_to_serve_scale_and_upgrade_the_crd():
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render({}, name="lockstep", namespace="lockstep-system")["lockstep/templates/NOTES.txt"]
    assert "kind: LLMService" in notes
    assert "kubectl scale llmservice/smollm2 --replicas=2" in notes
    assert "kubectl apply --server-side -f crds/" in notes


@pytest.mark.parametrize(
    "values",
    [{}, {"engineApiKey": {"secretName": "engine-key", "key": "api-key"}, "operator": {"clusterWide": True}}],
    ids=["defaults", "api-key"],
)
def test_every_chart_pod_passes_the_restricted_pod_security_standard(values):
    pods = [pod for doc in render(values) for pod in pod_specs(doc)]
    assert {name for name, _ in pods} == {
        "Deployment/lockstep-operator", "Deployment/lockstep-gateway", "Pod/lockstep-test-gateway",
    }  # fmt: skip
    for name, pod in pods:
        assert violations(pod) == [], name
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name


def test_helm_test_calls_the_gateway_health_and_models():
    (pod,) = [d for d in render() if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["command"][-1]
    assert "http://lockstep-gateway.lockstep-system.svc:80" in script
    assert '"/health"' in script and '"/v1/models"' in script


def test_the_pod_monitor_scrapes_leaders_only():
    (monitor,) = [d for d in render({"monitoring": {"podMonitor": {"enabled": True}}}) if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"]["apps.kubernetes.io/pod-index"] == "0"


def test_the_gateway_has_a_disruption_budget_when_it_has_replicas_to_spare():
    (pdb,) = [d for d in render() if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert not [d for d in render({"gateway": {"replicas": 1}}) if d["kind"] == "PodDisruptionBudget"]


@pytest.mark.parametrize(("gateway", "workers"), [
    ({}, "1"),  # the default request, 250m
    ({"resources": {"requests": {"cpu": "1500m"}}}, "2"),
    ({"resources": {"requests": {"cpu": 4}}}, "4"),
    ({"resources": {"requests": {"cpu": "0.5"}}}, "1"),
    ({"workers": 3}, "3"),
])
def test_the_gateway_runs_a_worker_per_requested_cpu(gateway, workers):
    assert f"--workers={workers}" in _gateway_args(render({"gateway": gateway}))


def test_an_image_digest_replaces_the_tag():
    digest = "sha256:" + "b" * 64
    docs = render({"engine": {"image": {"digest": digest}}, "operator": {"image": {"digest": digest}}})
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-operator")
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/lockstep-dev/lockstep-operator@{digest}"
    assert f"--engine-image=ghcr.io/lockstep-dev/lockstep@{digest}" in container["args"]


def _gateway_args(docs):
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-gateway")
    return gateway["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_gateway_discovers_where_the_operator_watches_with_matching_rbac():
    docs = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    assert [a for a in _gateway_args(docs) if "kubernetes" in a] == [
        "--kubernetes-namespace=team-a", "--kubernetes-namespace=team-b",
    ]  # fmt: skip
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "lockstep-gateway"]
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a", "team-b"]
    assert roles[0]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    ]


@pytest.mark.parametrize(
    "values",
    [{"operator": {"clusterWide": True}}, {"gateway": {"discoverAllNamespaces": True}}],
    ids=["cluster-wide-operator", "gateway-value"],
)
def test_the_gateway_can_discover_every_namespace(values):
    docs = render(values)
    assert [a for a in _gateway_args(docs) if "kubernetes" in a] == ["--kubernetes-all-namespaces"]
    assert [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "lockstep-gateway"]
    assert not [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "lockstep-gateway"]


def test_one_api_key_secret_reaches_the_gateway_and_the_example_engines():
    docs = render({"engineApiKey": {"secretName": "engine-key", "key": "k"}, "example": {"enabled": True}})
    assert "--engine-api-key-file=/var/run/lockstep/engine-api-key/k" in _gateway_args(docs)
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-gateway")
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["engine-api-key"]["secret"]["secretName"] == "engine-key"
    (example,) = [d for d in docs if d["kind"] == "LLMService"]
    assert example["spec"]["engine"]["apiKeySecret"] == {"name": "engine-key", "key": "k"}
    assert example["spec"]["engine"]["maxNumSeqs"] == 16
    assert not [a for a in _gateway_args(render()) if "engine-api-key" in a]


def test_network_policies_are_on_by_default_and_tell_the_operator():
    docs = render()
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"lockstep-operator", "lockstep-gateway"}
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-operator")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--network-policy", "--engine-client-namespace=lockstep-system", "--monitoring-namespace=monitoring"} <= set(args)
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-gateway")
    assert gateway["spec"]["template"]["metadata"]["labels"]["serving.lockstep.dev/engine-client"] == "true"
    off = render({"networkPolicy": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
    operator = next(d for d in off if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-operator")
    assert "--no-network-policy" in operator["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_readme_documents_every_value():
    """Every documented key of values.yaml (a `# --` comment above it) has a row in README.md."""
    readme = (CHART / "README.md").read_text()
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    keys = []

    def walk(node: yaml.MappingNode, path: str) -> None:
        for key_node, value_node in node.value:
            key = f"{path}{key_node.value}"
            if lines[key_node.start_mark.line - 1].strip().startswith("# -- "):
                keys.append(key)
            elif isinstance(value_node, yaml.MappingNode):
                walk(value_node, key + ".")

    walk(yaml.compose(text), "")
    assert len(keys) > 50
    assert [k for k in keys if f"| `{k}` |" not in readme] == []


def _gateway_policy(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "lockstep-gateway")


def _labels_of(docs: list[dict], kind: str, component: str) -> dict:
    doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
    return (doc["spec"]["template"]["metadata"] if kind == "Deployment" else doc["metadata"])["labels"]


def test_gateway_from_still_admits_the_operator_and_the_helm_test_pod():
    client = {"podSelector": {"matchLabels": {"team": "search"}}}
    docs = render({"networkPolicy": {"gatewayFrom": [client]}})
    peers = _gateway_policy(docs)["spec"]["ingress"][0]["from"]
    assert peers[0] == client
    selectors = [p["podSelector"]["matchLabels"] for p in peers if "podSelector" in p and p is not peers[0]]
    for kind, component in (("Deployment", "operator"), ("Pod", "test")):
        labels = _labels_of(docs, kind, component)
        assert any(all(labels.get(k) == v for k, v in s.items()) for s in selectors), (component, selectors)
    assert any("namespaceSelector" in p for p in peers)  # monitoring
    assert "from" not in _gateway_policy(render())["spec"]["ingress"][0]  # no gatewayFrom: anyone


def test_the_example_is_refused_where_no_operator_watches():
    with pytest.raises(Exception, match="does not watch"):
        render({"example": {"enabled": True}, "operator": {"watchNamespaces": ["team-a"]}})
    docs = render({"example": {"enabled": True}, "operator": {"watchNamespaces": ["team-a", "lockstep-system"]}})
    assert [d["metadata"]["namespace"] for d in docs if d["kind"] == "LLMService"] == ["lockstep-system"]


def test_the_gateway_is_ready_only_with_an_engine_spreads_its_replicas_and_bounds_tmp():
    (gateway,) = [d for d in render() if d["kind"] == "Deployment" and d["metadata"]["name"] == "lockstep-gateway"]
    pod = gateway["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert (container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]) == ("/ready", "/health")
    spread = pod["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in spread] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" and c["labelSelector"]["matchLabels"]["app.kubernetes.io/component"]
               == "gateway" for c in spread)  # fmt: skip
    for docs in (render(),):
        for deployment in (d for d in docs if d["kind"] == "Deployment"):
            volumes = deployment["spec"]["template"]["spec"]["volumes"]
            assert all("sizeLimit" in v["emptyDir"] for v in volumes if "emptyDir" in v), deployment["metadata"]["name"]


def test_every_crd_field_has_a_description():
    """What `kubectl explain llmservice.<field>` prints: every property, item and map value but the
    root's metadata (the API server forbids describing it)."""
    missing = []

    def walk(node: dict, path: str) -> None:
        if "description" not in node and path != ".metadata" and path != ".metadata.name":
            missing.append(path)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    for key, child in crd_schema()["properties"].items():
        walk(child, f".{key}")
    assert missing == []
