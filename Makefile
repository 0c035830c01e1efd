# Two commands work on a fresh machine: `make run` and `make test`.
# Everything Python goes into the checkout's own virtual environment, $(VENV) (made from the
# `python3` on PATH; uv, installed inside it, resolves and installs the packages). `make run` installs
# the serving extras only; `make test` adds the operator and the test tooling.
VENV ?= .venv
HOST_PYTHON ?= python3
PYTHON := $(VENV)/bin/python
UV := $(VENV)/bin/uv
MODEL ?= smollm2
PORT ?= 8000
RUN_EXTRAS := engine,gateway
TEST_EXTRAS := engine,gateway,operator,dev

.PHONY: run test install install-run model lint format bench-cpu clean k8s-bins

$(UV):
	$(HOST_PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --progress-bar off --disable-pip-version-check uv

# One stamp per set of extras, inside the environment (a new .venv starts with none).
$(VENV)/.deps-run: pyproject.toml | $(UV)
	@echo "install: the serving extras ($(RUN_EXTRAS)) into $(VENV): about 5.4 GB, 5.2 GB of it PyPI's CUDA build of torch (README.md, Where things go)" >&2
	$(UV) pip install --python $(PYTHON) -e ".[$(RUN_EXTRAS)]"
	@touch $@

$(VENV)/.deps-test: pyproject.toml | $(UV)
	@echo "install: every extra ($(TEST_EXTRAS)) into $(VENV)" >&2
	$(UV) pip install --python $(PYTHON) -e ".[$(TEST_EXTRAS)]"
	@touch $@ $(VENV)/.deps-run

install-run: $(VENV)/.deps-run
install: $(VENV)/.deps-test

model: install-run
	$(PYTHON) -m lockstep.cli fetch $(MODEL)

# The local stack: the gateway on $(PORT) and one engine group (N=8 decode steps per window).
run: model
	$(PYTHON) -m lockstep.cli up $(MODEL) --port $(PORT) --replicas 1 --num-scheduler-steps 8

test: install k8s-bins
	bash scripts/install-test-deps.sh
	$(MAKE) --no-print-directory lint
	PATH=$(abspath $(VENV))/bin:$$PATH $(PYTHON) -m pytest -q tests

# etcd, kube-apiserver and kube-controller-manager for tests/k8s, built from Go modules once and
# cached in ~/.cache/lockstep/kube (KUBEBUILDER_ASSETS is used where it has them).
k8s-bins:
	bash hack/kube/build.sh

# The linter (pyproject.toml [tool.ruff]) and the import contracts; formatting is not checked (pyproject.toml says why).
lint: install
	$(PYTHON) -m ruff check .
	$(VENV)/bin/lint-imports

# The formatter, with the same configuration: optional, not checked by `make lint`.
format: install
	$(PYTHON) -m ruff format .

bench-cpu: model
	$(PYTHON) -m lockstep.cli bench throughput $(MODEL) --workload sharegpt-synth --num-prompts 200 --num-scheduler-steps 1 8

clean:
	rm -rf $(VENV)

# The engine (CPU), gateway and operator images, built with buildah from Debian packages and PyPI
# wheels, no Docker or registry (images/build.sh; docs/CLUSTER.md). Needs root.
.PHONY: images e2e system-deps
# The Debian packages both need (buildah, debootstrap, containerd, runc, the CNI plugins, iptables,
# Prometheus, ...): installed with apt-get when missing (hack/system-deps.sh). Needs root or sudo.
system-deps:
	bash hack/system-deps.sh install

images: install
	PYTHON=$(abspath $(PYTHON)) bash images/build.sh

# A real single-node cluster (kubelet, containerd, CoreDNS), tests/e2e against it, then teardown.
# Not part of `make test`. Needs root and the archives of `make images` (docs/CLUSTER.md).
e2e: install
	PYTHON=$(abspath $(PYTHON)) PATH=$(abspath $(VENV))/bin:$$PATH bash hack/e2e/run.sh
