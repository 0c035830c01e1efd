"""Graceful shutdown and a dead engine core, each on a server of its own."""

import os
import signal
import threading

import httpx
import pytest

from api_harness import Server, stream_in_thread
from polling import wait_until


def start_stream(server: Server, max_tokens: int, results: list, index: int, first_chunk: threading.Event):
    """Streams one request in a thread; results[index] = (token count, finish_reason, error)."""
    streamed: dict = {}

    def run():
        stream_in_thread(server, [5, 6, 7 + index], max_tokens, streamed, index, first_chunk).join()
        tokens, finish, error = streamed[index]
        results[index] = (len(tokens), finish, error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def own_servers():
    """Two servers of their own, loading side by side: one to drain, one whose core gets killed."""
    args = ("--num-gpu-blocks-override", "512", "--num-scheduler-steps", "1", "--shutdown-grace-period", "120")
    servers = [Server("random:tiny", *args, name=name) for name in ("to-drain", "to-lose-its-core")]
    yield [server.wait_healthy() for server in servers]
    for server in servers:
        server.stop()


def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_0(own_servers):
    server = own_servers[0]
    # 1000 single-step windows: the streams are still running when SIGTERM arrives.
    results = [None] * 3
    started = [threading.Event() for _ in results]
    threads = [start_stream(server, 1000, results, i, started[i]) for i in range(len(results))]
    for event in started:
        assert event.wait(120)
    assert all(result is None for result in results), results  # all still streaming

    server.process.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 10, what="/health 503")
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    assert refused.headers["x-lockstep-retryable"] == "1"  # refused unstarted: a gateway may try another engine

    for thread in threads:
        thread.join(120)
    assert results == [(1000, "length", None)] * 3
    assert server.process.wait(60) == 0


def test_a_dead_core_fails_requests_in_flight_and_the_server_exits_1(own_servers):
    """Fatal means exit: the stream in flight ends with a 503 error event, then the server
    exits non-zero so that its supervisor restarts it."""
    server = own_servers[1]
    results = [None]
    started = threading.Event()
    thread = start_stream(server, 1500, results, 0, started)
    assert started.wait(60)

    os.kill(server.core_pid(), signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    tokens, finish, error = results[0]
    assert isinstance(error, dict) and error["code"] == 503 and "engine core" in error["message"], error
    assert tokens > 0 and finish is None
    assert server.process.wait(30) == 1
