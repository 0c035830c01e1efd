"""`Server`: a real `lockstep serve` process on 127.0.0.1 for the API tests.

Every server gets one intra-op thread (LOCKSTEP_CPU_THREADS=1): the machine has two cores and
OpenMP spin-waits under contention.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 240.0
API_KEY = "test-key"
MAX_BODY_BYTES = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `lockstep serve` process; `url` is its root. `launcher`: what runs `lockstep` (a script that plants a
    fault first, for instance)."""

    def __init__(self, model: str, *args: str, name: str | None = None, api_key: str | None = None,
                 launcher: tuple[str, ...] = ("-m", "lockstep.cli")):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.name = name or model
        self.log_path = os.path.join(os.environ.get("PYTEST_TMP", "/tmp"), f"lockstep-serve-{self.port}.log")
        command = [sys.executable, *launcher, "serve", model, "--host", "127.0.0.1",
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

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the /metrics series called `name` whose labels include `labels` (0 when none)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and labels.items() <= sample.labels.items())

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


def stream_in_thread(server: "Server", prompt: list[int], max_tokens: int, results, key,
                     started: threading.Event | None = None) -> threading.Thread:
    """Streams one greedy completion (`ignore_eos`, logprobs on) on a connection of its own, in a thread;
    results[key] = (token strings, finish reason, error). `started` is set at the first chunk (and at the end)."""

    def run():
        tokens, finish, error = [], None, None
        body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "logprobs": 0, "stream": True}
        try:
            with httpx.Client() as client, client.stream("POST", f"{server.url}/v1/completions", json=body,
                                                         timeout=120) as response:
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {response.read().decode()}"
                for line in response.iter_lines() if error is None else ():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]
                        break
                    tokens += chunk["choices"][0]["logprobs"]["tokens"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
                    if started is not None:
                        started.set()
        except httpx.HTTPError as exc:
            error = repr(exc)
        results[key] = (tokens, finish, error)
        if started is not None:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
