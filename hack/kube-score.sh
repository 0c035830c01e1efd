#!/usr/bin/env bash
# kube-score over what Lockstep deploys: the chart with default values, the chart with the example
# LLMService (and an engine API key; networkPolicy is on by default), and the objects the operator
# builds for charts/lockstep/examples/llmservice.yaml and llmservice-gpu.yaml. docs/KUBERNETES.md
# ("kube-score") answers every finding this prints.
#   hack/kube-score.sh [OUT_DIR]    manifests go to OUT_DIR (default a temporary directory)
# kube-score is built from the Go module proxy into ~/.cache/lockstep/bin (never into the repo).
set -euo pipefail

VERSION=v1.20.0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${LOCKSTEP_BIN:-$HOME/.cache/lockstep/bin}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"

if ! go version -m "$BIN/kube-score" 2>/dev/null | grep -q "kube-score[[:space:]]*$VERSION"; then
  GOBIN=$BIN go install "github.com/zegl/kube-score/cmd/kube-score@$VERSION"
fi

"$PYTHON" - "$ROOT" "$OUT" <<'EOF'
import json, pathlib, sys
import helm_python as helm
import yaml

root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sys.path.insert(0, str(root / "operator"))
from lockstep_operator import builders, pods
from lockstep_operator.config import OperatorConfig
from lockstep_operator.spec import parse_spec

def dump(name, docs):  # JSON documents: PyYAML leaves a digest such as 8e12345678 unquoted, a number to Go
    (out / name).write_text("".join(f"---\n{json.dumps(doc, indent=1)}\n" for doc in docs))

def render(values):
    with helm.Chart.load(str(root / "charts/lockstep")) as chart:
        manifests = chart.render(values, name="lockstep", namespace="lockstep-system")
    return [d for p, t in manifests.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]

dump("chart-defaults.yaml", render({}))
dump("chart-example.yaml", render({"example": {"enabled": True}, "networkPolicy": {"enabled": True},
                                   "engineApiKey": {"secretName": "engine-key"}}))
# As the chart starts the operator: policies on, the gateway's namespace, monitoring.
config = OperatorConfig(network_policy=True, engine_client_namespaces=("lockstep-system",),
                        monitoring_namespaces=("monitoring",))
for example in ("llmservice.yaml", "llmservice-gpu.yaml"):
    service = yaml.safe_load((root / "charts/lockstep/examples" / example).read_text())
    name = service["metadata"]["name"]
    owner = {"metadata": {"name": name, "namespace": "lockstep-system", "uid": "kube-score"}}
    spec = parse_spec(name, service["spec"], default_image=config.engine_image)
    docs = [*builders.service_objects(owner, spec, config), builders.group_secret(owner, spec),
            pods.group_statefulset(owner, spec, 0, config), builders.group_service(owner, spec, 0)]
    if config.network_policy:
        docs.append(builders.group_policy(owner, spec, 0))
    dump("operator-" + example, docs)
EOF

echo "kube-score $VERSION; manifests in $OUT"
for file in chart-defaults chart-example operator-llmservice operator-llmservice-gpu; do
  echo "== $file"
  # Findings only (kube-score exits 1 on any CRITICAL one: this script reports, it does not gate).
  "$BIN/kube-score" score --output-format ci "$OUT/$file.yaml" | grep -v '^\[OK\]\|^\[SKIPPED\]' || true
done
