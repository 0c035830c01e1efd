"""The gateway's `/health` and `/ping` are answered by its health listener process, not its event loop
(lockstep_common/health_listener.py): the answer equals the app's, it comes while the loop is provably
blocked, every other request still reaches the app, and each `--workers` worker has a listener of its own.

The loop is blocked for real: the gateway's stderr is a 4 KiB pipe that this test stops reading, and requests
that each log a warning (an engine that resets every connection: 502) fill it, so the loop's next log line
blocks in write(2); the main thread's /proc wchan shows it waiting there.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from gateway_harness import REPO, FakeEngine, children, free_port, wait_for
from http_probe import listener_pids, parse, probe, raw

PROBE_TIMEOUT_S = 10.0  # generous: the point is that it answers at all while the loop is blocked
# A dead listener's channel reads as EOF, or as a reset when the listener left bytes unread
LISTENER_LOST = r"the health listener process (closed|broke) its channel"
BLOCK_DEADLINE_S = 60.0  # for the loop to reach the blocking write; seconds on a loaded 2-core machine


class PipedGateway:
    """`lockstep gateway` writing its log to a 4 KiB pipe, read only when this test calls `read_log`."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "lockstep.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
                   "--health-check-interval", "0.2", *args]
        self.process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pipe = self.process.stdout.fileno()
        fcntl.fcntl(self.pipe, fcntl.F_SETPIPE_SZ, 4096)
        os.set_blocking(self.pipe, False)
        self.log = bytearray()

    def read_log(self) -> None:
        while True:
            try:
                chunk = os.read(self.pipe, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.log += chunk

    def health(self) -> dict:
        self.read_log()
        assert self.process.poll() is None, self.log.decode(errors="replace")[-3000:]
        answer = httpx.get(self.url + "/health", timeout=2)
        return answer.status_code == 200 and answer.json()

    def loop_blocked_on_the_pipe(self) -> bool:
        with open(f"/proc/{self.process.pid}/wchan") as handle:  # the main thread: uvicorn's event loop
            return handle.read().endswith("pipe_write")

    def stop(self) -> None:
        self.process.terminate()
        deadline = time.monotonic() + 30
        while self.process.poll() is None and time.monotonic() < deadline:
            self.read_log()  # a gateway blocked on its log cannot drain
            time.sleep(0.05)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def resetting_engine():
    with FakeEngine(["fake"], behaviour="reset") as fake:
        yield fake


@pytest.fixture
def gateway(resetting_engine):
    # Every failed request is logged (a breaker that never opens, no retry): each one writes to the pipe.
    gateway = PipedGateway(f"--engine={resetting_engine.url}", "--breaker-failures=1000000", "--max-retries=0")
    try:
        wait_for("the engine admitted", lambda: gateway.health() and gateway.health()["healthy_engines"] == 1)
        yield gateway
    finally:
        gateway.stop()


def same_answer(one, other) -> bool:
    """The same status, headers in the same order with the same values (but the date's) and the same body."""
    def without_date(headers: dict) -> dict:
        return {name: value for name, value in headers.items() if name != b"date"}

    return (one[0], one[1], without_date(one[2]), one[3]) == (other[0], other[1], without_date(other[2]), other[3])


def test_the_listener_answers_as_the_app_and_passes_everything_else_on(gateway):
    close = b"Host: x\r\nConnection: close\r\n\r\n"
    listener = parse(raw(gateway.port, b"GET /health HTTP/1.1\r\n" + close))
    # An Origin header sends the probe to the app (CORS could apply): the app's own answer to compare with.
    app = parse(raw(gateway.port, b"GET /health HTTP/1.1\r\nOrigin: http://example\r\n" + close))
    assert same_answer(listener, app)
    assert listener[0] == 200 and json.loads(listener[3]) == {"status": "ok", "engines": 1, "healthy_engines": 1,
                                                             "models": ["fake"]}
    assert same_answer(parse(raw(gateway.port, b"GET /ping HTTP/1.1\r\n" + close)), listener)
    assert parse(raw(gateway.port, b"POST /ping HTTP/1.1\r\nContent-Length: 0\r\n" + close))[0] == 200  # the app's
    # A key in the query string is the app's 401; HEAD is its 405.
    assert parse(raw(gateway.port, b"GET /health?api_key=x HTTP/1.1\r\n" + close))[0] == 401
    assert parse(raw(gateway.port, b"HEAD /health HTTP/1.1\r\n" + close))[0] == 405
    # Pipelined: the listener answers the probe, the app the request behind it, in order.
    both = raw(gateway.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /version HTTP/1.1\r\n" + close)
    first, second = both.split(b"HTTP/1.1 ")[1:]
    assert parse(b"HTTP/1.1 " + first)[0] == 200 and b'"version"' in parse(b"HTTP/1.1 " + second)[3]
    # Keep-alive: probes, then another route, then a probe again, all on one connection.
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    assert probe(gateway.port, connection) == 200 and probe(gateway.port, connection) == 200
    local = connection.sock.getsockname()
    connection.request("GET", "/v1/models")
    response = connection.getresponse()
    assert response.status == 200 and b'"fake"' in response.read()
    assert probe(gateway.port, connection) == 200 and connection.sock.getsockname() == local
    connection.close()


def test_health_answers_while_the_event_loop_is_blocked(gateway):
    body = b'{"model": "fake", "prompt": "hi", "max_tokens": 1}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % len(body) + body)
    failing = []
    for _ in range(200):  # each is a 502 and a warning line (about 120 bytes): the pipe fills after about 35
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
        sock.sendall(request)
        failing.append(sock)
    deadline = time.monotonic() + BLOCK_DEADLINE_S
    while not gateway.loop_blocked_on_the_pipe():
        assert time.monotonic() < deadline, f"the loop did not block:\n{gateway.log.decode(errors='replace')[-2000:]}"
        time.sleep(0.05)  # polling the wchan of a process that is working through the requests

    statuses = [probe(gateway.port) for _ in range(20)]  # a new connection each, as a kubelet's
    kept = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=PROBE_TIMEOUT_S)
    statuses += [probe(gateway.port, kept) for _ in range(5)]  # keep-alive
    kept.close()
    blocked = socket.create_connection(("127.0.0.1", gateway.port), timeout=60)
    blocked.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert gateway.loop_blocked_on_the_pipe()  # still: nothing was read, so every probe was answered meanwhile
    assert statuses == [200] * 25

    # Unblocked: the request the listener passed on while the loop was blocked gets its answer.
    blocked.setblocking(False)
    received = b""
    deadline = time.monotonic() + 60
    while not received.endswith(b"}"):
        assert time.monotonic() < deadline, received
        gateway.read_log()
        try:
            received += blocked.recv(1 << 16)
        except BlockingIOError:
            time.sleep(0.01)  # between reads of the pipe that unblocks the gateway
    blocked.close()
    for sock in failing:
        sock.close()
    assert parse(received)[0] == 200 and b'"version"' in parse(received)[3]
    assert probe(gateway.port) == 200


def test_each_worker_has_its_own_listener_and_dies_without_it(start_gateway, resetting_engine):
    """`--workers 2`: a listener per worker, on that worker's SO_REUSEPORT socket. A worker whose listener dies
    takes no connections: it exits 1, and the supervisor stops the gateway with that code."""
    gateway = start_gateway(f"--engine={resetting_engine.url}", "--workers=2")
    workers = wait_for("two workers with a listener each", lambda: len(children(gateway.process.pid)) == 2
                       and all(len(listener_pids(pid)) == 1 for pid in children(gateway.process.pid))
                       and children(gateway.process.pid))
    answers = [httpx.get(gateway.url + "/health", timeout=PROBE_TIMEOUT_S) for _ in range(20)]
    assert all(answer.status_code == 200 and answer.json()["status"] == "ok" for answer in answers)
    os.kill(listener_pids(workers[0])[0], signal.SIGKILL)
    assert gateway.process.wait(60) == 1
    wait_for("the worker's reason in the log", lambda: re.search(LISTENER_LOST,
                                                                 gateway.log_path.read_text(errors="replace")))


def test_a_gateway_whose_listener_dies_exits_1(start_gateway, resetting_engine):
    gateway = start_gateway(f"--engine={resetting_engine.url}")
    listeners = listener_pids(gateway.process.pid)
    assert len(listeners) == 1, listeners
    os.kill(listeners[0], signal.SIGKILL)
    assert gateway.process.wait(60) == 1
    assert re.search(LISTENER_LOST, gateway.log_path.read_text(errors="replace"))
