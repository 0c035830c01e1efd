"""Real `lockstep serve` processes on 127.0.0.1, shared per session: starting one costs seconds.

Servers that several modules use start together on first use (their model loads overlap), and
each waits for `/health` with a deadline. Every server gets one intra-op thread
(LOCKSTEP_CPU_THREADS=1): the machine has two cores and OpenMP spin-waits under contention.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 240.0
API_KEY = "test-key"
MAX_BODY_BYTES = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `lockstep serve` process; `url` is its root."""

    def __init__(self, model: str, *args: str, name: str | None = None, api_key: str | None = None):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.name = name or model
        self.log_path = os.path.join(os.environ.get("PYTEST_TMP", "/tmp"), f"lockstep-serve-{self.port}.log")
        command = [sys.executable, "-m", "lockstep.cli", "serve", model, "--host", "127.0.0.1",
                   "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        env = {**os.environ, "LOCKSTEP_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> "Server":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as handle:
            return b"\n".join(handle.read().splitlines()[-lines:]).decode(errors="replace")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120.0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=120.0, **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name (labels dropped) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
                values.setdefault(name.split("{")[0], float(value))
        return values

    def core_pid(self) -> int:
        """The engine-core child process of this server."""
        children = open(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read().split()
        pids = [int(pid) for pid in children]
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if b"spawn_main" in handle.read():
                    return pid
        raise RuntimeError(f"no engine-core child among {pids}")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def servers():
    """Lazily started shared servers; all are stopped at the end of the session."""
    started: dict[str, Server] = {}

    def get(key: str) -> Server:
        if key not in started:
            for spec_key in _GROUPS[key]:
                if spec_key not in started:
                    model, args, kwargs = _SPECS[spec_key]
                    started[spec_key] = Server(model, *args, name=spec_key, **kwargs)
        return started[key].wait_healthy()

    yield get
    for server in started.values():
        server.stop()


_SPECS = {
    # SmolLM2 where text matters; N=8 (the default) and N=1 for the same requests.
    "smol8": ("smollm2", ("--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)), {}),
    "smol1": ("smollm2", ("--num-scheduler-steps", "1", "--max-model-len", "128",
                          "--kv-cache-memory-bytes", str(128 << 20)), {}),
    # A tiny random model where only token counts matter; guarded by an API key.
    "tiny": ("random:tiny", ("--num-gpu-blocks-override", "512", "--max-num-seqs", "128", "--max-model-len", "1024",
                             "--max-request-body-bytes", str(MAX_BODY_BYTES)), {"api_key": API_KEY}),
}
# Starting one SmolLM2 server starts the other too, so their model loads overlap.
_GROUPS = {"smol8": ("smol8", "smol1"), "smol1": ("smol8", "smol1"), "tiny": ("tiny",)}


@pytest.fixture(scope="session")
def smol8(servers) -> Server:
    return servers("smol8")


@pytest.fixture(scope="session")
def smol1(servers) -> Server:
    return servers("smol1")


@pytest.fixture(scope="session")
def tiny(servers) -> Server:
    return servers("tiny")


@pytest.fixture(scope="session")
def offline_smollm2():
    """The offline engine on the same model: what greedy text through the API must equal."""
    from lockstep_engine.llm import LLM

    return LLM("smollm2", num_scheduler_steps=8, max_model_len=1024, kv_cache_memory_bytes=128 << 20)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)
