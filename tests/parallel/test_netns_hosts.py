"""A PP=2 engine group whose ranks live on two "hosts": network namespaces joined by a veth pair,
made by this test (root and iproute2 needed). The tokens must equal the single-process ones."""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from test_parallel import SCRIPT, TINY_PROMPTS, _run

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and iproute2 to make network namespaces")

LEADER_ADDR, WORKER_ADDR = "10.231.77.1", "10.231.77.2"


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    tag = uuid.uuid4().hex[:6]
    hosts = (f"lsa{tag}", f"lsb{tag}")
    links = (f"vla{tag}", f"vlb{tag}")
    try:
        for host in hosts:
            _ip("netns", "add", host)
            _ip("-n", host, "link", "set", "lo", "up")
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link, addr in zip(hosts, links, (LEADER_ADDR, WORKER_ADDR)):
            _ip("link", "set", link, "netns", host)
            _ip("-n", host, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", host, "link", "set", link, "up")
        yield hosts, links
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True, timeout=30)


def test_pp2_across_network_namespaces(two_hosts, tmp_path):
    """The leader reads the group secret from a file (as a pod's mounted Secret), the worker from its
    environment: the same secret, so both prove it at the rendezvous."""
    (leader_ns, worker_ns), (leader_link, worker_link) = two_hosts
    secret = "bmV0bnMtZ3JvdXAtc2VjcmV0LW5ldG5zLWdyb3VwLXM="
    (tmp_path / "secret").write_text(secret + "\n")
    config = {"model": "random:tiny", "pipeline_parallel_size": 2, "num_scheduler_steps": 8,
              "kv_cache_memory_bytes": 128 << 20, "max_model_len": 512}
    common = dict(os.environ, LOCKSTEP_CPU_THREADS="1", LOCKSTEP_WORLD_SIZE="2", LOCKSTEP_LEADER_ADDR=LEADER_ADDR,
                  LOCKSTEP_RENDEZVOUS_PORT="29731", PYTHONPATH=os.pathsep.join(sys.path))
    worker = subprocess.Popen(["ip", "netns", "exec", worker_ns, sys.executable, "-m", "lockstep.cli", "worker"],
                              env=dict(common, LOCKSTEP_RANK="1", GLOO_SOCKET_IFNAME=worker_link,
                                       LOCKSTEP_ENGINE_CONFIG=json.dumps(config), LOCKSTEP_GROUP_SECRET=secret),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        leader = subprocess.run(
            ["ip", "netns", "exec", leader_ns, sys.executable, "-c", SCRIPT, "random:tiny", "1x2", "8",
             json.dumps(TINY_PROMPTS), "24"],
            env=dict(common, LOCKSTEP_RANK="0", GLOO_SOCKET_IFNAME=leader_link,
                     LOCKSTEP_GROUP_SECRET_FILE=str(tmp_path / "secret")),
            capture_output=True, text=True, timeout=300)
        assert leader.returncode == 0, leader.stderr[-3000:]
        across = json.loads(leader.stdout.strip().splitlines()[-1])
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert across == _run("random:tiny", 1, 8, TINY_PROMPTS, 24)
