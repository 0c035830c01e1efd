"""The group channel: ranks prove the group secret at the rendezvous, control frames are authenticated,
and a group that cannot form is an error within the rendezvous timeout, not a hang."""

import json
import os
import socket
import subprocess
import sys

SECRET = "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3I="  # 44 characters, as the operator's file holds
OTHER_SECRET = "b3RoZXItb3RoZXItb3RoZXItb3RoZXItb3RoZXItb3Q="
CONFIG = {"model": "random:tiny", "tensor_parallel_size": 2, "num_scheduler_steps": 4,
          "kv_cache_memory_bytes": 32 << 20, "max_model_len": 128}

# Rank 0 of a TP=2 group whose rank 1 runs elsewhere (LOCKSTEP_RANK=0: it spawns none).
LEADER = r"""
import json, os, sys, time
from lockstep_engine.llm import LLM
from lockstep_engine.sampling_params import SamplingParams
started = time.monotonic()
try:
    llm = LLM(**json.loads(sys.argv[1]))
except Exception as error:
    print(f"after {time.monotonic() - started:.1f}s: {type(error).__name__}: {error}", flush=True)
    sys.exit(3)
out = llm.generate([[3, 5, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print(json.dumps(out[0].outputs[0].token_ids), flush=True)
"""

# Two ranks and the channel alone (no model): the leader sends one good frame and one altered in flight.
CHANNEL = r"""
import os, sys
from lockstep_engine.group import channel as group_channel
from lockstep_engine.group.channel import WINDOW
from lockstep_engine.group.errors import AuthenticationError
from lockstep_engine.group.rendezvous import exit_rank, init_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
_, chan = init_group(rank, 2, "127.0.0.1", port, "cpu", os.environ["LOCKSTEP_GROUP_SECRET"].encode(), 2)
if rank == 0:
    chan.send(WINDOW, b'["a plan"]')
    seal = group_channel.seal
    def tampered(*args):
        frame = bytearray(seal(*args))
        frame[-2] ^= 1  # one bit of the payload, as a peer on the path could flip it
        return bytes(frame)
    group_channel.seal = tampered
    chan.send(WINDOW, b'["a plan"]')
    exit_rank(0)
print("received", chan.receive(), flush=True)
try:
    chan.receive()
except AuthenticationError as error:
    print(f"refused: {error}", flush=True)
    exit_rank(0)
print("accepted a tampered frame", flush=True)
exit_rank(1)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(port: int, rank: int, secret: str | None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCKSTEP_GROUP_SECRET_FILE", "LOCKSTEP_GROUP_SECRET")}
    env.update(LOCKSTEP_CPU_THREADS="1", LOCKSTEP_RANK=str(rank), LOCKSTEP_WORLD_SIZE="2",
               LOCKSTEP_LEADER_ADDR="127.0.0.1", LOCKSTEP_RENDEZVOUS_PORT=str(port), **extra)
    if secret is not None:
        env["LOCKSTEP_GROUP_SECRET"] = secret
    return env


def _leader(port: int, secret: str | None, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LEADER, json.dumps(CONFIG)], env=_env(port, 0, secret, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _worker(port: int, secret: str | None, **extra) -> subprocess.Popen:
    env = _env(port, 1, secret, LOCKSTEP_ENGINE_CONFIG=json.dumps(CONFIG), **extra)
    return subprocess.Popen([sys.executable, "-m", "lockstep.cli", "worker"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"still running after {timeout}s: {(out + err)[-3000:]}") from None
    return process.returncode, out + err


def test_a_rank_with_the_wrong_secret_is_refused_on_both_sides(tmp_path):
    port = free_port()
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")  # the leader reads the mounted file, as in a pod
    leader = _leader(port, None, LOCKSTEP_GROUP_SECRET_FILE=str(secret_file), LOCKSTEP_RENDEZVOUS_TIMEOUT_S="120")
    worker = _worker(port, OTHER_SECRET, LOCKSTEP_RENDEZVOUS_TIMEOUT_S="120")
    leader_code, leader_out = _finish(leader)
    worker_code, worker_out = _finish(worker)
    assert leader_code == 3, leader_out[-3000:]
    assert "AuthenticationError: rank 0: refused rank(s) [1]: their hello failed authentication" in leader_out
    assert worker_code == 1, worker_out[-3000:]
    assert f"rank 1: the leader at 127.0.0.1:{port} failed authentication" in worker_out


def test_a_rank_without_a_secret_cannot_join():
    worker = _worker(free_port(), None)
    code, out = _finish(worker)
    assert code == 1, out[-3000:]
    assert "rank 1: an engine group needs a shared secret on every rank: set LOCKSTEP_GROUP_SECRET_FILE" in out


def test_a_group_that_cannot_form_is_an_error_within_the_rendezvous_timeout():
    """Rank 1 never comes: rank 0 exits naming it; a rank 1 whose leader never comes exits too."""
    leader = _leader(free_port(), SECRET, LOCKSTEP_RENDEZVOUS_TIMEOUT_S="3")
    worker = _worker(free_port(), SECRET, LOCKSTEP_RENDEZVOUS_TIMEOUT_S="3")
    leader_code, leader_out = _finish(leader)
    worker_code, worker_out = _finish(worker)
    assert leader_code == 3, leader_out[-3000:]
    line = next(line for line in leader_out.splitlines() if line.startswith("after "))
    assert "GroupError: rank 0: rank(s) [1] of the 2 did not join the group at 127.0.0.1:" in line
    assert "within 3s (LOCKSTEP_RENDEZVOUS_TIMEOUT_S)" in line
    assert 3.0 <= float(line.split()[1].rstrip("s:")) < 30.0, line  # the wait ends at the timeout, not days later
    assert worker_code == 1, worker_out[-3000:]
    assert "did not answer within 3s (LOCKSTEP_RENDEZVOUS_TIMEOUT_S)" in worker_out


def test_a_frame_altered_in_flight_is_refused_by_the_worker():
    port = free_port()
    env = dict(os.environ, LOCKSTEP_GROUP_SECRET=SECRET, LOCKSTEP_RENDEZVOUS_TIMEOUT_S="60")
    ranks = [subprocess.Popen([sys.executable, "-c", CHANNEL, str(rank), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    (leader_code, leader_out), (worker_code, worker_out) = (_finish(rank) for rank in ranks)
    assert leader_code == 0, leader_out[-3000:]
    assert worker_code == 0, worker_out[-3000:]
    assert "received (1, b'[\"a plan\"]')" in worker_out
    assert "refused: control message 1 failed authentication (HMAC-SHA256 under the group secret)" in worker_out
