"""`lockstep up`: the local stack as real processes — gateway + engines, progress, clean Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
from gateway_harness import ENGINE_START_TIMEOUT_S, MODEL, free_port, start_up, wait_for, wait_up
from http_probe import listener_pids


def _kill_whole(up) -> None:
    """After a failed assertion: take the engines down with `up`, or they outlive the test."""
    if up.poll() is None:
        leftover = _descendants(up.pid)
        up.kill()
        up.wait()
        for pid in leftover:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


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
    up = start_up(MODEL, port, log_path, "--replicas", "2", "--num-scheduler-steps", "4")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(up, url, log_path, 2, timeout=ENGINE_START_TIMEOUT_S)
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
        wait_up(up, url, log_path, 2, timeout=60)  # the restarted engine readmitted
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
        _kill_whole(up)
    output = log_path.read_text()
    assert "[engine 0] [lockstep] loading weights" in output and "[engine 1]" in output
    assert "ready: OpenAI API at" in output and "restarting it" in output and "stopped" in output


def test_up_stops_whole_when_its_gateways_health_listener_dies(tmp_path):
    """The gateway inside `up` answers /health from a health listener process; without it the gateway takes no
    connections, so `up` stops everything and exits 1 (its supervisor restarts it whole)."""
    port = free_port()
    log_path = tmp_path / "up.log"
    up = start_up(MODEL, port, log_path)
    processes: set[int] = set()
    try:
        wait_up(up, f"http://127.0.0.1:{port}", log_path, 1, timeout=ENGINE_START_TIMEOUT_S)
        listeners = listener_pids(up.pid)  # the gateway's (the engine's listener is its API server's child)
        assert len(listeners) == 1, listeners
        processes = _descendants(up.pid)
        os.kill(listeners[0], signal.SIGKILL)
        assert up.wait(timeout=60) == 1
        wait_for("every engine process to exit", lambda: not any(_alive(p) for p in processes), timeout=30)
    finally:
        _kill_whole(up)
    output = log_path.read_text()
    # EOF, or a reset where the dead listener left unread bytes behind
    assert re.search(r"the health listener process (closed|broke) its channel", output)
    assert "the gateway's health listener process died; stopping" in output and "stopped" in output


def test_an_engine_that_dies_while_it_starts_is_restarted_and_then_stops_the_stack(tmp_path):
    """Every death before `up` saw the engine ready counts the same, wherever start-up was: restarted with
    the back-off of a crash, and after three such starts in a row `up` exits with the engine's code (a
    wrong model would only die again)."""
    log_path = tmp_path / "up.log"
    up = start_up("random:no-such-shape", free_port(), log_path)
    try:
        code = up.wait(timeout=180)
    finally:
        _kill_whole(up)
    output = log_path.read_text()
    assert code != 0, output
    assert output.count("restarting it in") == 2, output
    assert "before it was ready, 3 starts in a row; stopping" in output, output
