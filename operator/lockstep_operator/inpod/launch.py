"""Engine pod launcher, mounted from the LLMService's ConfigMap by the Lockstep operator.

  launch.py ARGS...   starts this pod's ranks of the engine group: ranks
                      LOCKSTEP_POD_INDEX x LOCKSTEP_RANKS_PER_POD + 0 .. LOCKSTEP_RANKS_PER_POD - 1.
                      Rank 0 runs `lockstep serve ARGS`, every other rank `lockstep worker ARGS`.
                      Pod 0's ranks reach the leader on 127.0.0.1; the ranks of other pods first
                      wait until the leader's stable DNS name (LOCKSTEP_LEADER_ADDR) resolves.
                      When any rank of the pod exits, the others are stopped and the launcher exits
                      with that rank's status: the container restarts and the operator restarts the
                      whole group (a group cannot survive a lost rank).
  launch.py --probe   startup/readiness/liveness check: GET /health on the leader, a no-op elsewhere.

With LOCKSTEP_LORA_ADAPTERS_FILE set (a service with LoRA adapters), the launcher also runs lora_sync.py
beside the ranks, which fetches the listed adapters and loads them into the leader's engine; the leader's
probe then also waits for its first pass (LOCKSTEP_LORA_READY_FILE).
"""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

DEFAULT_LORA_READY_FILE = "/tmp/lockstep-lora-ready"


def fail(message):
    print(f"launch.py: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def env_int(name, default=None):
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            fail(f"{name} is not set (the operator sets it on every engine pod)")
        return default
    try:
        return int(value)
    except ValueError:
        fail(f"{name}={value!r} is not an integer")


def lora_ready_file():
    return os.environ.get("LOCKSTEP_LORA_READY_FILE", DEFAULT_LORA_READY_FILE)


def probe(pod_index):
    if pod_index != 0:
        return 0
    if os.environ.get("LOCKSTEP_LORA_ADAPTERS_FILE") and not os.path.exists(lora_ready_file()):
        print("launch.py: the LoRA adapters are not loaded yet (lora_sync.py's first pass)", file=sys.stderr)
        return 1
    port = env_int("LOCKSTEP_HTTP_PORT", 8000)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError as error:
        print(f"launch.py: leader /health: {error}", file=sys.stderr)
        return 1


def link_image_models():
    """Models baked into the image (LOCKSTEP_IMAGE_MODELS/<name>) seed the writable cache, so a
    source such as `smollm2` is found there offline instead of being downloaded."""
    image_models = os.environ.get("LOCKSTEP_IMAGE_MODELS", "/opt/lockstep/models")
    cache = os.environ.get("LOCKSTEP_CACHE")
    if not cache or not os.path.isdir(image_models):
        return
    os.makedirs(cache, exist_ok=True)
    for name in sorted(os.listdir(image_models)):
        target = os.path.join(cache, name)
        if not os.path.lexists(target):
            os.symlink(os.path.join(image_models, name), target)


def wait_for_leader(address, seconds):
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.getaddrinfo(address, None)
            return
        except socket.gaierror:
            if time.monotonic() >= deadline:
                fail(f"leader {address} did not resolve within {seconds}s")
            time.sleep(1)


def rank_command(rank, args):
    return ["lockstep", "serve" if rank == 0 else "worker", *args]


def start_lora_sync():
    """lora_sync.py from beside this file, in its own process; its first pass makes the leader ready."""
    ready_file = lora_ready_file()
    if os.path.exists(ready_file):
        os.remove(ready_file)  # /tmp outlives a container restart: the new engine has no adapters yet
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_sync.py")
    return subprocess.Popen([sys.executable, program], env=dict(os.environ, LOCKSTEP_LORA_READY_FILE=ready_file))


def supervise(processes, helpers=()):
    """Wait for the first rank to exit; stop the others and the helpers; return its exit status.

    A helper that exits (lora_sync.py) is not a lost rank: the ranks keep serving."""
    def forward(signum, _frame):
        for process in [*processes, *helpers]:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        pid, status = os.wait()
        exited = next((p for p in processes if p.pid == pid), None)
        if exited is not None:
            break
        if any(helper.pid == pid for helper in helpers):
            print(f"launch.py: helper process {pid} exited with {os.waitstatus_to_exitcode(status)}", file=sys.stderr, flush=True)
    code = os.waitstatus_to_exitcode(status)
    exited.returncode = code
    print(f"launch.py: rank process {pid} exited with {code}; stopping the pod's other ranks", file=sys.stderr, flush=True)
    for process in [*processes, *helpers]:
        if process.poll() is None:
            process.terminate()
    for process in [*processes, *helpers]:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return code if code > 0 else (1 if code < 0 else 0)


def main(argv):
    pod_index = env_int("LOCKSTEP_POD_INDEX")
    if argv[:1] == ["--probe"]:
        return probe(pod_index)
    ranks_per_pod = env_int("LOCKSTEP_RANKS_PER_POD", 1)
    world_size = env_int("LOCKSTEP_WORLD_SIZE", ranks_per_pod)
    first_rank = pod_index * ranks_per_pod
    if ranks_per_pod < 1 or first_rank + ranks_per_pod > world_size:
        fail(f"pod {pod_index} with {ranks_per_pod} ranks per pod does not fit LOCKSTEP_WORLD_SIZE={world_size}")
    link_image_models()
    if pod_index == 0:
        # The leader is in this pod: its ranks meet on loopback, without waiting for DNS.
        os.environ["LOCKSTEP_LEADER_ADDR"] = "127.0.0.1"
    else:
        wait_for_leader(os.environ["LOCKSTEP_LEADER_ADDR"], env_int("LOCKSTEP_LEADER_WAIT_SECONDS", 600))
    helpers = [start_lora_sync()] if os.environ.get("LOCKSTEP_LORA_ADAPTERS_FILE") else []
    if ranks_per_pod == 1 and not helpers:
        os.environ.update(LOCKSTEP_RANK=str(first_rank), LOCKSTEP_LOCAL_RANK="0")
        os.execvp("lockstep", rank_command(first_rank, argv))
    processes = []
    for local_rank in range(ranks_per_pod):
        rank = first_rank + local_rank
        env = dict(os.environ, LOCKSTEP_RANK=str(rank), LOCKSTEP_LOCAL_RANK=str(local_rank))
        processes.append(subprocess.Popen(rank_command(rank, argv), env=env))
    return supervise(processes, helpers)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
