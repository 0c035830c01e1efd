"""The engine pod launcher (launch.py from the engine ConfigMap), run by a real python3.

Most tests put a small stand-in `lockstep` on PATH that records how the launcher started it; one
test runs the real engine: a TP=2 group in one pod, both ranks started by the launcher.
"""

from __future__ import annotations

import http.server
import json
import base64
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from k8s_harness import free_port, wait_for
from lockstep_operator.inpod import LAUNCHER

# Records (command, rank, local rank, leader) as one JSON line, waits (at most 20 s) until the
# pod's LOCKSTEP_RANKS_PER_POD ranks have all recorded, then behaves as LOCKSTEP_FAKE says:
# "exit" exits 0, "exit:<rank>:<code>" makes that rank exit with <code> and the others wait.
STAND_IN = f"""#!{sys.executable}
import json, os, sys, time
record = {{"command": sys.argv[1], "args": sys.argv[2:], "rank": os.environ["LOCKSTEP_RANK"],
          "local_rank": os.environ.get("LOCKSTEP_LOCAL_RANK"), "leader": os.environ.get("LOCKSTEP_LEADER_ADDR")}}
path = os.environ["LOCKSTEP_RECORD"]
with open(path, "a") as out:
    out.write(json.dumps(record) + "\\n")
deadline = time.monotonic() + 20
while len(open(path).read().splitlines()) < int(os.environ.get("LOCKSTEP_RANKS_PER_POD", "1")):
    if time.monotonic() > deadline:
        sys.exit(99)
    time.sleep(0.05)
mode = os.environ.get("LOCKSTEP_FAKE", "exit")
if mode == "exit":
    sys.exit(0)
_, rank, code = mode.split(":")
if rank == os.environ["LOCKSTEP_RANK"]:
    sys.exit(int(code))
time.sleep(120)
"""


@pytest.fixture
def launch(tmp_path: Path):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "lockstep"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    record = tmp_path / "record.jsonl"

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        full_env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "LOCKSTEP_RECORD": str(record),
            "LOCKSTEP_IMAGE_MODELS": str(tmp_path / "no-image-models"),
            **env,
        }
        return subprocess.run(
            [sys.executable, str(script), *args], env=full_env, capture_output=True, text=True, timeout=60
        )

    def started() -> list[dict]:
        lines = record.read_text().splitlines() if record.exists() else []
        return sorted((json.loads(line) for line in lines), key=lambda r: int(r["rank"]))

    run.started = started  # type: ignore[attr-defined]
    run.bin_dir = bin_dir  # type: ignore[attr-defined]
    run.tmp = tmp_path  # type: ignore[attr-defined]
    return run


def test_a_one_rank_pod_zero_runs_the_api_server_as_rank_zero(launch):
    result = launch("smollm2", "--port", "8000", LOCKSTEP_POD_INDEX="0", LOCKSTEP_WORLD_SIZE="2")
    assert result.returncode == 0, result.stderr
    (started,) = launch.started()
    assert (started["command"], started["args"], started["rank"]) == ("serve", ["smollm2", "--port", "8000"], "0")
    assert started["leader"] == "127.0.0.1"


def test_a_one_rank_pod_waits_for_the_leader_name_then_joins_as_a_worker(launch):
    result = launch(
        "smollm2", LOCKSTEP_POD_INDEX="3", LOCKSTEP_WORLD_SIZE="4", LOCKSTEP_LEADER_ADDR="localhost"
    )
    assert result.returncode == 0, result.stderr
    (started,) = launch.started()
    assert (started["command"], started["rank"], started["leader"]) == ("worker", "3", "localhost")


def test_a_four_gpu_pod_of_a_tp4_pp2_group_starts_its_four_local_ranks(launch):
    """Pod 1 of two: ranks 4..7, all workers, each told its local rank (its GPU)."""
    result = launch(
        "/models/llama", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
        LOCKSTEP_POD_INDEX="1", LOCKSTEP_RANKS_PER_POD="4", LOCKSTEP_WORLD_SIZE="8",
        LOCKSTEP_LEADER_ADDR="localhost",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    started = launch.started()
    assert [(r["command"], r["rank"], r["local_rank"]) for r in started] == [
        ("worker", "4", "0"), ("worker", "5", "1"), ("worker", "6", "2"), ("worker", "7", "3"),
    ]  # fmt: skip
    assert {r["leader"] for r in started} == {"localhost"}
    assert all(r["args"][0] == "/models/llama" for r in started)


def test_pod_zero_starts_the_leader_and_its_local_workers_reach_it_on_loopback(launch):
    result = launch(
        "m", LOCKSTEP_POD_INDEX="0", LOCKSTEP_RANKS_PER_POD="2", LOCKSTEP_WORLD_SIZE="4",
        LOCKSTEP_LEADER_ADDR="llama-g0-0.llama-g0.prod.svc.cluster.local",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [(r["command"], r["rank"], r["leader"]) for r in launch.started()] == [
        ("serve", "0", "127.0.0.1"), ("worker", "1", "127.0.0.1"),
    ]  # fmt: skip


def test_when_one_local_rank_exits_the_others_are_stopped_and_its_status_returned(launch):
    start = time.monotonic()
    result = launch(
        "m", LOCKSTEP_POD_INDEX="0", LOCKSTEP_RANKS_PER_POD="3", LOCKSTEP_WORLD_SIZE="3", LOCKSTEP_FAKE="exit:1:7"
    )
    assert result.returncode == 7
    assert time.monotonic() - start < 30  # the ranks that kept waiting were stopped, not waited for
    assert "exited with 7; stopping the pod's other ranks" in result.stderr
    assert len(launch.started()) == 3


def test_a_pod_that_does_not_fit_the_group_refuses_to_start(launch):
    result = launch("m", LOCKSTEP_POD_INDEX="2", LOCKSTEP_RANKS_PER_POD="4", LOCKSTEP_WORLD_SIZE="8")
    assert result.returncode == 2
    assert "pod 2 with 4 ranks per pod does not fit LOCKSTEP_WORLD_SIZE=8" in result.stderr
    assert launch.started() == []


def test_a_worker_gives_up_when_the_leader_never_resolves(launch):
    result = launch(
        "smollm2",
        LOCKSTEP_POD_INDEX="1",
        LOCKSTEP_WORLD_SIZE="2",
        LOCKSTEP_LEADER_ADDR="llama-g0-0.llama-g0.prod.svc.cluster.invalid",
        LOCKSTEP_LEADER_WAIT_SECONDS="0",
    )
    assert result.returncode == 2
    assert "leader llama-g0-0.llama-g0.prod.svc.cluster.invalid did not resolve within 0s" in result.stderr
    assert launch.started() == []


def test_a_pod_without_its_index_refuses_to_start(launch):
    result = launch("smollm2")
    assert result.returncode == 2
    assert "LOCKSTEP_POD_INDEX is not set" in result.stderr


def test_models_baked_into_the_image_are_found_by_the_engine_offline(launch):
    """The image's /opt/lockstep/models/smollm2/<gguf> is linked into the cache, where the
    engine's own `smollm2` source looks before downloading anything."""
    image_models = launch.tmp / "image-models"
    (image_models / "smollm2").mkdir(parents=True)
    gguf = image_models / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    resolver = launch.bin_dir / "lockstep"
    resolver.write_text(
        f"#!{sys.executable}\nfrom lockstep_engine.sources import fetch_smollm2\nprint(fetch_smollm2())\n"
    )
    cache = launch.tmp / "cache" / "lockstep"
    result = launch(
        "smollm2", LOCKSTEP_POD_INDEX="0", LOCKSTEP_CACHE=str(cache), LOCKSTEP_IMAGE_MODELS=str(image_models)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(cache / "smollm2" / gguf.name)
    assert (cache / "smollm2").resolve() == image_models / "smollm2"


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


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_a_tp2_group_in_one_pod_serves_and_a_lost_rank_ends_the_pod(tmp_path):
    """The real engine: the launcher starts `lockstep serve` (rank 0) and `lockstep worker`
    (rank 1) in one "pod"; the group answers through the API; killing rank 1 ends the launcher
    with an error, so the kubelet restarts the container and the operator the group."""
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    port = free_port()
    secret = tmp_path / "group-secret"  # what the operator mounts from the LLMService's group Secret
    secret.write_text(base64.b64encode(os.urandom(32)).decode())
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "LOCKSTEP_POD_INDEX": "0",
        "LOCKSTEP_RANKS_PER_POD": "2",
        "LOCKSTEP_WORLD_SIZE": "2",
        "LOCKSTEP_LEADER_ADDR": "tiny-g0-0.tiny-g0.test.svc.cluster.invalid",
        "LOCKSTEP_RENDEZVOUS_PORT": str(free_port()),
        "LOCKSTEP_CACHE": str(tmp_path / "cache"),
        "LOCKSTEP_IMAGE_MODELS": str(tmp_path / "none"),
        "LOCKSTEP_GROUP_SECRET_FILE": str(secret),
    }
    log = (tmp_path / "pod.log").open("w")
    pod = subprocess.Popen(
        [sys.executable, str(script), "random:tiny", "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "tiny", "--tensor-parallel-size", "2", "--num-scheduler-steps", "8",
         "--num-gpu-blocks-override", "128", "--max-model-len", "512", "--device", "cpu"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)

        def serving() -> bool:
            assert pod.poll() is None, (tmp_path / "pod.log").read_text()[-3000:]
            try:
                return bool(client.models.list().data)
            except openai.APIError:
                return False

        wait_for("the TP=2 pod to serve", serving, timeout=180)
        ranks = _children(pod.pid)
        assert len(ranks) == 2
        completion = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert completion.usage.completion_tokens == 4
        os.kill(ranks[1], signal.SIGKILL)  # rank 1 (started second)
        assert pod.wait(timeout=60) != 0
        assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
                   for pid in ranks)  # fmt: skip
        assert "stopping the pod's other ranks" in (tmp_path / "pod.log").read_text()
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait(timeout=30)
        log.close()
