"""`/health` is answered by the health listener process, not the API process's event loop
(api/health_listener.py): it answers while that loop is provably blocked, its answers equal the app's, and
every other request on the same listener still reaches the app.

The loop is blocked for real: the server's stderr is a pipe that this test stops reading, so the loop's next
log line (uvicorn's warning for an invalid request) blocks in write(2) until the test reads again; the
main thread's /proc wchan shows it waiting there.
"""

from __future__ import annotations

import fcntl
import http.client
import os
import re
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time

import httpx
import pytest

from api_harness import REPO, START_TIMEOUT_S, free_port
from http_probe import listener_pids, parse, raw
from http_probe import probe as probe_port

HEADER_TIMEOUT_S = 1.0
BLOCK_DEADLINE_S = 60.0  # for the loop to reach the blocking write; seconds on a loaded 2-core machine
PROBE_TIMEOUT_S = 10.0  # generous: the point is that it answers at all while the loop is blocked


class PipedServer:
    """`lockstep serve random:tiny` whose stdout and stderr go to a small pipe that `drain` reads or stops reading."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "lockstep.cli", "serve", "random:tiny", "--host", "127.0.0.1",
                   "--port", str(self.port), "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                   "--header-read-timeout", str(HEADER_TIMEOUT_S),
                   "--engine-heartbeat-timeout", "600"]  # its watchdog runs on the loop this test blocks
        env = {**os.environ, "LOCKSTEP_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pipe = self.process.stdout.fileno()
        self.pipe_size = fcntl.fcntl(self.pipe, fcntl.F_SETPIPE_SZ, 4096)  # a few dozen log lines fill it
        self.output = bytearray()
        self._reading = None
        self.drain(True)

    def drain(self, on: bool) -> None:
        if not on:
            self._reading.set()
            self._reader.join(10)
            assert not self._reader.is_alive()
            return
        self._reading = stop = threading.Event()

        def read():
            while not stop.is_set():
                if select.select([self.pipe], [], [], 0.05)[0]:  # a bounded wait so that `stop` is seen
                    chunk = os.read(self.pipe, 1 << 16)
                    if not chunk:
                        return
                    self.output += chunk

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def queued_bytes(self) -> int:
        return int.from_bytes(fcntl.ioctl(self.pipe, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)

    def loop_blocked_on_the_pipe(self) -> bool:
        with open(f"/proc/{self.process.pid}/wchan") as handle:  # the main thread: uvicorn's event loop
            return handle.read().endswith("pipe_write")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output.decode(errors="replace")[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # between polls of a server that is starting
        raise AssertionError(f"not healthy after {START_TIMEOUT_S:.0f} s:\n{self.output.decode(errors='replace')}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.drain(False)


@pytest.fixture(scope="module")
def server():
    server = PipedServer()
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def probe(server: PipedServer, connection: http.client.HTTPConnection | None = None) -> int:
    return probe_port(server.port, connection, PROBE_TIMEOUT_S)


def test_the_listener_answers_as_the_app_and_passes_everything_else_on(server):
    close = b"Host: x\r\nConnection: close\r\n\r\n"
    listener = parse(raw(server.port, b"GET /health HTTP/1.1\r\nX-Request-Id: probe-1\r\n" + close))
    # An Origin header sends the probe to the app (CORS could apply): the app's own answer to compare with.
    app = parse(raw(server.port, b"GET /health HTTP/1.1\r\nOrigin: http://example\r\nX-Request-Id: probe-2\r\n" + close))
    assert listener[0] == app[0] == 200
    assert listener[1] == app[1]  # the same headers in the same order
    assert listener[3] == app[3] == b""
    assert listener[2][b"x-request-id"] == b"probe-1" and app[2][b"x-request-id"] == b"probe-2"
    assert parse(raw(server.port, b"GET /ping HTTP/1.1\r\n" + close))[0] == 200

    # Pipelined: the listener answers the probe, the app the request behind it, in order.
    both = raw(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /version HTTP/1.1\r\n" + close)
    first, second = both.split(b"HTTP/1.1 ")[1:]
    assert parse(b"HTTP/1.1 " + first)[0] == 200 and parse(b"HTTP/1.1 " + second)[3] == b'{"version":"0.1.0"}'

    # Keep-alive: probes, then another route, then a probe again, all on one connection.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    assert probe(server, connection) == 200 and probe(server, connection) == 200
    local = connection.sock.getsockname()
    connection.request("GET", "/v1/models")
    response = connection.getresponse()
    assert response.status == 200 and b"random:tiny" in response.read()
    assert probe(server, connection) == 200 and connection.sock.getsockname() == local
    connection.close()

    # What the listener does not answer: HEAD (405 from the app, as before), a query string (the app's 400
    # for a key in it), a malformed request (the HTTP parser's 400).
    assert parse(raw(server.port, b"HEAD /health HTTP/1.1\r\n" + close))[0] == 405
    assert parse(raw(server.port, b"GET /health?api_key=x HTTP/1.1\r\n" + close))[0] == 400
    assert parse(raw(server.port, b"GET /health HTTP/1.1\r\nHost x\r\n\r\n"))[0] == 400  # a header without a colon

    # A probe that arrives in pieces is answered; headers that never end are closed after the header timeout,
    # in the listener (a probe) or in the app (any other request, its deadline carried over).
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /hea")
        sock.sendall(b"lth HTTP/1.1\r\n" + close)
        assert parse(sock.recv(1 << 16))[0] == 200
    for start in (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        started = time.monotonic()
        assert raw(server.port, start) == b""  # closed without an answer
        assert time.monotonic() - started >= HEADER_TIMEOUT_S * 0.9


def test_health_answers_while_the_event_loop_is_blocked(server):
    server.drain(False)
    try:
        # Each invalid request makes the loop log a warning; once the pipe is full, the next one blocks it.
        sockets = []
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"NOT HTTP\r\n\r\n")
            sockets.append(sock)
        deadline = time.monotonic() + BLOCK_DEADLINE_S
        while not server.loop_blocked_on_the_pipe():
            assert time.monotonic() < deadline, f"the loop did not block ({server.queued_bytes()} bytes queued)"
            time.sleep(0.05)  # polling the wchan of a process that is working through the requests
        assert server.pipe_size - server.queued_bytes() < 100

        statuses = [probe(server) for _ in range(20)]  # a new connection each, as a kubelet's
        kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=PROBE_TIMEOUT_S)
        statuses += [probe(server, kept) for _ in range(5)]  # keep-alive, as the gateway's pool
        kept.close()
        blocked = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        blocked.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert server.loop_blocked_on_the_pipe()  # still: nothing was read, so every probe was answered meanwhile
        assert statuses == [200] * 25
    finally:
        server.drain(True)
    # Unblocked: the request the listener passed on while the loop was blocked gets its answer.
    received = b""
    while chunk := blocked.recv(1 << 16):
        received += chunk
    blocked.close()
    for sock in sockets:
        sock.close()
    assert parse(received)[0] == 200 and parse(received)[3] == b'{"version":"0.1.0"}'
    assert probe(server) == 200


def test_a_stopped_api_process_is_not_reported_healthy(server):
    """The listener answers only for an API process that runs: SIGSTOP it, and probes go to it and time out, as
    they did before the listener; after SIGCONT they are answered again."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while True:  # the first probes may still get the answer of the last second
            assert time.monotonic() < deadline, "the listener kept answering for a stopped API process"
            try:
                probe(server, http.client.HTTPConnection("127.0.0.1", server.port, timeout=3))
            except TimeoutError:
                break
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if probe(server) == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "no 200 after SIGCONT"


def test_serve_exits_1_when_its_listener_dies(server):
    """Without its listener the server takes no connections: it exits non-zero, so that its supervisor restarts
    it (this test ends the module's server)."""
    listeners = listener_pids(server.process.pid)
    assert len(listeners) == 1, listeners
    os.kill(listeners[0], signal.SIGKILL)
    assert server.process.wait(60) == 1
    deadline = time.monotonic() + 10  # for the reader thread to take the last lines from the pipe
    while not re.search(rb"the health listener process (closed|broke) its channel", server.output):
        assert time.monotonic() < deadline, server.output.decode(errors="replace")[-2000:]
        time.sleep(0.05)

