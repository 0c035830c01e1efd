# Two commands work on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
MODEL ?= smollm2
PORT ?= 8000
EXTRAS ?= engine,gateway,operator,dev
STAMP := .deps-installed

.PHONY: run test install model lint format bench-cpu clean k8s-bins

$(STAMP): pyproject.toml
	$(PIP) install --progress-bar off -e ".[$(EXTRAS)]"
	@touch $(STAMP)

install: $(STAMP)

model: install
	$(PYTHON) -m lockstep.cli fetch $(MODEL)

# The local stack: the gateway on $(PORT) and one engine group (N=8 decode steps per window).
run: model
	$(PYTHON) -m lockstep.cli up $(MODEL) --port $(PORT) --replicas 1 --num-scheduler-steps 8

test: install k8s-bins
	bash scripts/install-test-deps.sh
	$(MAKE) --no-print-directory lint
	$(PYTHON) -m pytest -q tests

# etcd, kube-apiserver and kube-controller-manager for tests/k8s, built from Go modules once and
# cached in ~/.cache/lockstep/kube (KUBEBUILDER_ASSETS is used where it has them).
k8s-bins:
	bash hack/kube/build.sh

# One linter and formatter configuration for the tree (pyproject.toml [tool.ruff]) and the import contracts.
lint: install
	$(PYTHON) -m ruff check .
	lint-imports

# The formatter, with the same configuration (not yet enforced by `make lint`: the tree predates it).
format: install
	$(PYTHON) -m ruff format .

bench-cpu: model
	$(PYTHON) -m lockstep.cli bench throughput $(MODEL) --workload sharegpt-synth --num-prompts 200 --num-scheduler-steps 1 8

clean:
	rm -f $(STAMP)

# The engine (CPU), gateway and operator images, built with buildah from Debian packages and PyPI
# wheels, no Docker or registry (images/build.sh; docs/CLUSTER.md). Needs root.
.PHONY: images e2e system-deps
# The Debian packages both need (buildah, debootstrap, containerd, runc, the CNI plugins, iptables,
# Prometheus, ...): installed with apt-get when missing (hack/system-deps.sh). Needs root or sudo.
system-deps:
	bash hack/system-deps.sh install

images:
	bash images/build.sh

# A real single-node cluster (kubelet, containerd, CoreDNS), tests/e2e against it, then teardown.
# Not part of `make test`. Needs root and the archives of `make images` (docs/CLUSTER.md).
e2e: install
	bash hack/e2e/run.sh
