"""The engine pod launcher, run by a real /bin/sh with a stand-in `lockstep` on PATH."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest

from k8s_harness import free_port
from lockstep_operator.launcher import LAUNCHER

FAKE_LOCKSTEP = """#!/bin/sh
echo "command=$1"
shift
echo "args=$*"
echo "rank=$LOCKSTEP_RANK"
"""


@pytest.fixture
def launch(tmp_path: Path):
    script = tmp_path / "launch.sh"
    script.write_text(LAUNCHER)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "lockstep"
    fake.write_text(FAKE_LOCKSTEP)
    fake.chmod(0o755)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
        return subprocess.run(
            ["/bin/sh", str(script), *args], env=full_env, capture_output=True, text=True, timeout=30
        )

    run.bin_dir = bin_dir  # type: ignore[attr-defined]
    return run


def test_pod_zero_runs_the_api_server_with_rank_zero(launch):
    result = launch("smollm2", "--port", "8000", LOCKSTEP_POD_INDEX="0", LOCKSTEP_RANKS_PER_POD="2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["command=serve", "args=smollm2 --port 8000", "rank=0"]


def test_other_pods_wait_for_the_leader_name_then_join_as_workers(launch):
    result = launch(
        "smollm2",
        "--port",
        "8000",
        LOCKSTEP_POD_INDEX="3",
        LOCKSTEP_RANKS_PER_POD="2",
        LOCKSTEP_LEADER_ADDR="localhost",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["command=worker", "args=smollm2 --port 8000", "rank=6"]


def test_a_worker_gives_up_when_the_leader_never_resolves(launch):
    getent = launch.bin_dir / "getent"
    getent.write_text("#!/bin/sh\nexit 2\n")
    getent.chmod(0o755)
    result = launch(
        "smollm2",
        LOCKSTEP_POD_INDEX="1",
        LOCKSTEP_LEADER_ADDR="llama-g0-0.llama-g0.prod.svc.cluster.local",
        LOCKSTEP_LEADER_WAIT_SECONDS="0",
    )
    assert result.returncode == 1
    assert "leader llama-g0-0.llama-g0.prod.svc.cluster.local did not resolve" in result.stderr
    assert "command=" not in result.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "ok"), [(200, True), (503, False)])
def test_probe_asks_the_leader_health_endpoint(launch, status, ok):
    handler = type("Handler", (_Health,), {"status": status})
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = launch("--probe", LOCKSTEP_POD_INDEX="0", LOCKSTEP_HTTP_PORT=str(port))
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is ok


def test_probe_on_a_worker_succeeds_without_a_server(launch):
    result = launch("--probe", LOCKSTEP_POD_INDEX="2", LOCKSTEP_HTTP_PORT=str(free_port()))
    assert result.returncode == 0


def test_a_pod_without_its_index_refuses_to_start(launch):
    result = launch("smollm2")
    assert result.returncode != 0
    assert "LOCKSTEP_POD_INDEX is not set" in result.stderr
