"""`lockstep up`: the local stack as real processes — gateway + engines, progress, clean Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from gateway_harness import ENGINE_START_TIMEOUT_S, MODEL, REPO, free_port, wait_for


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        children = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True,
                                  check=False).stdout.split()
        for child in map(int, children):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Load:
    """Clients sending completions back to back from a thread: (start time, status) per request."""

    def __init__(self, url: str, clients: int = 4):
        self.url = url
        self.clients = clients
        self.results: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        async def client_loop() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                while not self._stop.is_set():
                    started = time.monotonic()
                    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}
                    try:
                        status = (await client.post(self.url + "/v1/completions", json=body)).status_code
                    except httpx.HTTPError:
                        status = 0
                    self.results.append((started, status))

        await asyncio.gather(*[client_loop() for _ in range(self.clients)])


def _port_of(pid: int) -> int:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--port") + 1])


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_up_serves_restarts_a_crashed_engine_and_ctrl_c_leaves_no_process_behind(tmp_path):
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "up", MODEL, "--replicas", "2",
                               "--port", str(port), "--kv-cache-memory-bytes", str(64 << 20),
                               "--num-scheduler-steps", "4"],
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "LOCKSTEP_CPU_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            assert up.poll() is None, log_path.read_text()
            return httpx.get(url + "/health", timeout=2).json()["healthy_engines"] == 2

        wait_for("both engines behind the gateway", ready, timeout=ENGINE_START_TIMEOUT_S, interval=0.2)
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
        assert response.status_code == 200 and response.json()["model"] == MODEL
        processes = _descendants(up.pid)
        assert len(processes) >= 4  # two API servers and their engine cores

        crashed = min(p for p in processes if b"\0serve\0" in Path(f"/proc/{p}/cmdline").read_bytes())
        load = _Load(url)
        load.start()
        wait_for("the load to run", lambda: len(load.results) >= 20, timeout=60)
        engine_port = _port_of(crashed)
        os.kill(crashed, signal.SIGKILL)  # an engine crashes: `up` starts it again, the gateway readmits it
        # SIGKILL takes effect when the process has exited, not when kill() returns; until its listener
        # closes, a request can still reach it and die with it (the gateway cannot tell that from a
        # poison). "Had not started" means sent after the engine was gone: its port refuses connections.
        wait_for("the killed engine's port to refuse connections", lambda: not _accepts(engine_port),
                 timeout=10, interval=0.005)
        killed_at = time.monotonic()
        wait_for("the crashed engine to be ejected",
                 lambda: httpx.get(url + "/health", timeout=2).json()["healthy_engines"] == 1, timeout=30)
        wait_for("the restarted engine to be readmitted", ready, timeout=60, interval=0.2)
        back_after = time.monotonic() - killed_at
        load.stop()
        failed = [(started, status) for started, status in load.results if status != 200]
        # none that had not started (the log says which engine lost which request and why)
        assert all(started < killed_at for started, _ in failed), (killed_at, failed, log_path.read_text()[-4000:])
        assert all(status in (502, 503) for _, status in failed) and len(failed) <= load.clients
        assert sum(started >= killed_at for started, _ in load.results) >= 10
        print(f"up --replicas 2, kill -9 of one engine under load: {len(load.results)} requests, "
              f"{len(failed)} failed (all in progress at the kill), back and admitted after {back_after:.1f}s")
        response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
        assert response.status_code == 200
        processes |= _descendants(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        wait_for("every engine process to exit", lambda: not any(_alive(p) for p in processes), timeout=15)
    finally:
        if up.poll() is None:  # a failed assertion: take the engines down too, or they outlive the test
            leftover = _descendants(up.pid)
            up.kill()
            up.wait()
            for pid in leftover:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    output = log_path.read_text()
    assert "[engine 0] [lockstep] loading weights" in output and "[engine 1]" in output
    assert "ready: OpenAI API at" in output and "restarting it" in output and "stopped" in output
