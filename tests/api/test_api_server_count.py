"""`lockstep serve --api-server-count N`: N API-server processes on one port, one engine core.

Real servers on `random:tiny` (token ids in, logprob tokens out): many streams through the one port give
the greedy tokens one API server gives; the requests land on every API server (each server's own share of
the metrics, as it publishes it, is counted) and /metrics through any connection gives the totals; a client
that disconnects has its request aborted; kill -9 of one API server, or of the core, stops the whole
server with exit 1 and leaves no process behind.
"""

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api_harness import REPO, Server, stream_in_thread
from lockstep_common import metrics_names as n
from lockstep_common import vllm_metrics as v
from polling import wait_until

ARGS = ("--num-gpu-blocks-override", "1024", "--max-model-len", "2048", "--num-scheduler-steps", "4")
COUNT = 2


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().decode().split("\0")


def _api_servers(server: Server) -> dict[int, list[str]]:
    """pid -> command line of each API server the supervisor started."""
    found = {}
    for pid in _children(server.process.pid):
        line = _cmdline(pid)
        if "--api-server-index" in line:
            found[pid] = line
    return found


def _core(server: Server) -> int:
    cores = [pid for pid in _children(server.process.pid) if any("spawn_main" in arg for arg in _cmdline(pid))]
    assert len(cores) == 1, cores
    return cores[0]


def _family_of(server: Server) -> set[int]:
    """The supervisor's descendants: API servers, their health listeners, the core."""
    found, todo = set(), [server.process.pid]
    while todo:
        for child in _children(todo.pop()):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _scrape(server: Server, name: str, **labels) -> float:
    """One /metrics through a fresh connection (so any API server may answer): the sum of a series."""
    with httpx.Client() as client:
        text = client.get(f"{server.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _settled_total(server: Server) -> float:
    """The requests finished so far, once scrapes through 8 connections agree on it (the earlier tests' last
    requests may reach another server's published part up to 0.1 s later)."""
    def agreed():
        totals = {_scrape(server, v.REQUEST_SUCCESS + "_total") for _ in range(8)}
        return totals.pop() if len(totals) == 1 else None
    return wait_until(agreed, 10, "scrapes that agree")


@pytest.fixture(scope="module")
def servers():
    """One API server and COUNT of them, same engine flags, loading side by side."""
    started = [Server("random:tiny", *ARGS, name="one"),
               Server("random:tiny", *ARGS, "--api-server-count", str(COUNT), name="several")]
    yield [server.wait_healthy() for server in started]
    for server in started:
        assert server.stop() == 0, server.log_tail()


def test_streams_through_the_one_port_get_the_tokens_one_api_server_gives(servers):
    one, several = servers
    prompts = [[3 + i % 7, 11, 5 + i, 2] for i in range(24)]
    outputs = []
    for server in (one, several):
        results: dict = {}
        threads = [stream_in_thread(server, prompt, 24, results, i) for i, prompt in enumerate(prompts)]
        for thread in threads:
            thread.join(120)
        assert len(results) == len(prompts) and all(error is None for _, _, error in results.values()), results
        outputs.append([results[i] for i in range(len(prompts))])
    assert all(len(tokens) == 24 and finish == "length" for tokens, finish, _ in outputs[1])
    assert outputs[1] == outputs[0]


def test_requests_land_on_every_api_server_and_any_scrape_gives_the_totals(servers):
    several = servers[1]
    before = _settled_total(several)
    sent = 30
    body = {"model": several.model, "prompt": [7, 7, 7], "max_tokens": 3}
    for _ in range(sent):  # a connection each: the kernel spreads them over the listening sockets
        with httpx.Client() as client:
            assert client.post(f"{several.url}/v1/completions", json=body, timeout=60).status_code == 200
    # Every scrape, whichever server answers it, sums the servers (another server's part is <= 0.1 s old).
    wait_until(lambda: all(_scrape(several, v.REQUEST_SUCCESS + "_total") == before + sent for _ in range(8)), 10,
               "every scrape counts every request")
    # Each server's own part, as it publishes it for the others: every one served some of them.
    run_dir = next(iter(_api_servers(several).values()))
    run_dir = run_dir[run_dir.index("--run-dir") + 1]
    own, delays = [], []
    for index in range(COUNT):
        with open(os.path.join(run_dir, f"api-server-{index}.metrics"), "rb") as handle:
            (counters, _), registry = pickle.load(handle)
        own.append(sum(counters.get(n.REQUESTS_FINISHED, {}).values()))
        delays += [value for _, _, _, samples in registry for name, _, value in samples
                   if name == "lockstep_api_stream_delay_seconds_count"]
    assert all(count > 0 for count in own), own
    assert sum(own) == before + sent
    # The API servers' own prometheus_client histogram (the earlier test's streamed chunks) is summed too.
    assert sum(delays) > 0 and _scrape(several, "lockstep_api_stream_delay_seconds_count") == sum(delays)


def test_a_client_that_disconnects_has_its_request_aborted(servers):
    several = servers[1]
    aborted = _scrape(several, v.REQUEST_SUCCESS + "_total", finished_reason="abort")
    streaming = [threading.Event() for _ in range(4)]
    hang_up = threading.Event()

    def stream_then_hang_up(i: int) -> None:
        body = {"model": several.model, "prompt": [9, i, 9], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.Client() as client, client.stream("POST", f"{several.url}/v1/completions", json=body,
                                                     timeout=60) as response:
            for _ in response.iter_lines():  # read on (a client that stops reading is cut off anyway)
                streaming[i].set()
                if hang_up.is_set():
                    return  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=stream_then_hang_up, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    for event in streaming:
        assert event.wait(60)
    assert _scrape(several, v.NUM_REQUESTS_RUNNING) == 4
    hang_up.set()
    for thread in threads:
        thread.join(30)
    wait_until(lambda: _scrape(several, v.NUM_REQUESTS_RUNNING) == 0, 30, "the engine running nothing")
    wait_until(lambda: _scrape(several, v.REQUEST_SUCCESS + "_total", finished_reason="abort") == aborted + 4, 10,
               "four aborts counted")


@pytest.mark.parametrize("victim", ["api-server", "core", "supervisor"])
def test_kill_9_stops_the_whole_server_with_exit_1_and_leaves_no_process(victim):
    """kill -9 of an API server or the core: exit 1. Of the supervisor itself: its API servers get SIGTERM and
    drain, and the core stops after them."""
    server = Server("random:tiny", *ARGS, "--api-server-count", str(COUNT), "--shutdown-grace-period", "10",
                    name=f"lose-{victim}").wait_healthy()
    try:
        family = _family_of(server)
        results: dict = {}
        started = [threading.Event() for _ in range(6)]
        threads = [stream_in_thread(server, [4, i, 4], 300, results, i, started[i]) for i in range(6)]
        for event in started:
            assert event.wait(60)
        target = {"api-server": lambda: next(iter(_api_servers(server))), "core": lambda: _core(server),
                  "supervisor": lambda: server.process.pid}[victim]()
        os.kill(target, signal.SIGKILL)
        assert server.process.wait(60) == (-signal.SIGKILL if victim == "supervisor" else 1)
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        # A stream either ended in full (the surviving server drained it) or got an error; none hung.
        assert all(error is not None or (len(tokens), finish) == (300, "length")
                   for tokens, finish, error in results.values()), results
        wait_until(lambda: not any(_alive(pid) for pid in family), 30, "no process of the server left")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        server.stop()


@pytest.mark.parametrize("flags, message", [
    (("--api-server-count", "0"), "--api-server-count=0 is out of range: allowed >= 1"),
    (("--api-server-count", "2", "--uds", "/tmp/lockstep-never.sock"), "--api-server-count=2 cannot be used with --uds"),
])
def test_a_bad_value_is_refused_naming_the_flag(flags, message):
    done = subprocess.run([sys.executable, "-m", "lockstep.cli", "serve", "random:tiny", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_port_another_reuseport_listener_holds_is_refused():
    """SO_REUSEPORT would let the API servers share the port with any listener of the same user that set it too:
    the port is checked with a plain bind first."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "lockstep.cli", "serve", "random:tiny", "--host", "127.0.0.1",
                               "--port", str(port), "--api-server-count", "2"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 1 and f"--port {port}: cannot listen on 127.0.0.1" in done.stderr, done.stderr


def test_health_waits_for_every_api_server_and_a_lost_one_turns_it_503(tmp_path):
    """What /health adds with several API servers (ServerState.health_reason): all of them published, none lost."""
    from lockstep_engine.api.peers import ApiServerGroup, Peers

    mine = Peers(ApiServerGroup(0, 2, str(tmp_path)), lambda: ({}, {}))
    mine.publish()
    assert not mine.all_ready()  # the other server's core connection is not ready yet
    other = Peers(ApiServerGroup(1, 2, str(tmp_path)), lambda: ({"x": {(): 2.0}}, {}))
    other.publish()
    assert mine.all_ready() and mine.others() == [({"x": {(): 2.0}}, {})]
    os.remove(other.group.path(1))  # the supervisor forgets a lost server at once
    assert not mine.all_ready()


def test_the_admission_limit_holds_over_all_api_servers():
    """--max-num-seqs 4 --max-queued-requests 0 over 2 API servers: each admits 2, so however the kernel spreads
    12 concurrent streams over the servers, at most 4 run and the rest get 503 at once."""
    server = Server("random:tiny", *ARGS, "--api-server-count", str(COUNT), "--max-num-seqs", "4",
                    "--max-queued-requests", "0", name="limits").wait_healthy()
    try:
        results: dict = {}
        threads = [stream_in_thread(server, [6, i, 6], 600, results, i) for i in range(12)]
        for thread in threads:
            thread.join(120)
        served = [key for key, (_, finish, error) in results.items() if error is None and finish == "length"]
        refused = [key for key, (_, _, error) in results.items() if error and error.startswith("HTTP 503")]
        assert len(served) + len(refused) == 12, results
        assert 2 <= len(served) <= 4, results
    finally:
        assert server.stop() == 0
