"""A real `lockstep serve random:tiny` and a real Prometheus server scraping it, on 127.0.0.1.

Both are shared by the session's tests (starting them costs seconds). Every wait is a poll with a
deadline. Servers get one intra-op thread (LOCKSTEP_CPU_THREADS=1): the machine has two cores.
"""

from __future__ import annotations

import pytest
from metrics_harness import Server


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("metrics"))


@pytest.fixture(scope="session")
def servers(log_dir):
    """Both servers start together (their startups overlap) and stop together."""
    started = {
        # random:tiny at N=8: token counts and timing are what matter, not text. With overlap (the CUDA
        # default; off by default on the CPU), so its windows and counter are measured as a GPU serves them.
        "main": Server(log_dir, "random:tiny", "--num-scheduler-steps", "8", "--max-model-len", "1024",
                       "--num-gpu-blocks-override", "1024", "--async-scheduling"),
        # 12 KV blocks of 16 tokens and 2 seats: concurrent requests wait, and two long ones preempt. On the
        # CPU wherever the tests run: on a GPU the four requests end before a scrape sees any of them wait.
        "small_cache": Server(log_dir, "random:tiny", "--num-scheduler-steps", "4", "--max-model-len", "1024",
                              "--num-gpu-blocks-override", "12", "--block-size", "16", "--max-num-seqs", "2",
                              "--device", "cpu", name="serve-small-cache"),
    }
    try:
        for server in started.values():
            server.wait_http(f"{server.url}/health")
        yield started
    finally:
        for server in started.values():
            server.terminate()
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def server(servers) -> Server:
    return servers["main"]


@pytest.fixture(scope="session")
def small_cache_server(servers) -> Server:
    return servers["small_cache"]
