"""`lockstep gateway --workers 2`: two processes share the port, /metrics sums them, SIGTERM stops both,
and a dead worker takes the gateway down so that its supervisor restarts it whole."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from gateway_harness import children, free_port, wait_for


@pytest.fixture(scope="module")
def upstream():
    """The benchmark's fake engine: answers as an engine does, in milliseconds, without a model."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "lockstep.bench.fake_upstream", "--port", str(port),
                                "--chunk-interval-ms", "5"])
    try:
        wait_for("the fake engine", lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def established(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of the established TCP connections process `pid` holds (/proc/net/tcp)."""
    inodes, held = socket_inodes(pid), []
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and fields[9] in inodes:
                held.append((int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)))
    return held


def accepted_from(pid: int, port: int, client_ports: set[int]) -> int:
    """Connections accepted on `port` that process `pid` holds, from these client ports. (Counting every
    connection on the port also counted, under load, one the test had closed before and whose end the
    worker had not read yet.)"""
    return sum(local == port and remote in client_ports for local, remote in established(pid))


def test_two_workers_share_the_port_and_metrics_add_up(start_gateway, upstream):
    gateway = start_gateway(f"--engine={upstream}", "--workers=2")
    workers = wait_for("two workers", lambda: len(children(gateway.process.pid)) == 2 and children(gateway.process.pid))
    body = {"model": "bench", "prompt": "hello", "max_tokens": 3, "stream": True}
    wait_for("the engine admitted by both workers",
             lambda: all(httpx.post(gateway.url + "/v1/completions", json=body, timeout=10).status_code == 200
                         for _ in range(8)), timeout=30)
    before = gateway.metric("lockstep_gateway_requests_total", route="completions", status="200")
    clients = [httpx.Client(timeout=10) for _ in range(20)]  # one kept-alive connection each
    try:
        for client in clients:
            answer = client.post(gateway.url + "/v1/completions", json=body)
            assert answer.status_code == 200 and answer.text.count("data: {") == 3
        client_ports = {local for local, remote in established(os.getpid()) if remote == gateway.port}
        assert len(client_ports) == 20, client_ports  # each client still holds its connection
        held = {pid: accepted_from(pid, gateway.port, client_ports) for pid in workers}
        assert sum(held.values()) == 20 and all(held.values()), held  # the kernel spread them over both
    finally:
        for client in clients:
            client.close()
    after = gateway.metric("lockstep_gateway_requests_total", route="completions", status="200")
    assert after - before == 20  # every worker's requests, whichever answered the scrape

    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(30) == 0
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]  # drained, exited and reaped


def test_a_dead_worker_stops_the_gateway_with_an_error(start_gateway, upstream):
    gateway = start_gateway(f"--engine={upstream}", "--workers=2")
    workers = wait_for("two workers", lambda: len(children(gateway.process.pid)) == 2 and children(gateway.process.pid))
    os.kill(workers[0], signal.SIGKILL)
    assert gateway.process.wait(30) != 0
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{workers[1]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{workers[1]}")  # the other worker was stopped with it
    with open(gateway.log_path) as log:
        assert "stopping the gateway" in log.read()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", gateway.port), timeout=2).close()
