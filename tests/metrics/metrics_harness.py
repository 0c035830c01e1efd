"""Processes for the metrics tests: `lockstep serve`, Prometheus, and /metrics parsing (used by conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from lockstep_common.metrics_names import parse_samples
from polling import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 120.0
SCRAPE_INTERVAL_S = 0.25


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Scrape:
    """One /metrics answer: `get(name, **labels)` sums the samples matching the given labels."""

    def __init__(self, text: str):
        self.text = text
        self.samples = parse_samples(text)

    def get(self, name: str, **labels) -> float:
        want = {(k, str(v)) for k, v in labels.items()}
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def bucket(self, name: str, le: str, **labels) -> float:
        return self.get(f"{name}_bucket", le=le, **labels)


class Process:
    def __init__(self, name: str, command: list[str], log_dir: str, env: dict | None = None):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self._terminated = False
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as handle:
            return b"\n".join(handle.read().splitlines()[-lines:]).decode(errors="replace")

    def wait_http(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        def up():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                return httpx.get(url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout_s, f"{self.name} answering {url}", interval_s=0.2)

    def terminate(self) -> None:
        """SIGTERM once (a second one would skip the server's drain)."""
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


class Server(Process):
    """`lockstep serve MODEL` on a free port."""

    def __init__(self, log_dir: str, model: str, *args: str, name: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        command = [sys.executable, "-m", "lockstep.cli", "serve", model, "--host", "127.0.0.1",
                   "--port", str(self.port), *args]
        env = {**os.environ, "LOCKSTEP_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        super().__init__(name, command, log_dir, env)

    def scrape(self) -> Scrape:
        return Scrape(httpx.get(f"{self.url}/metrics", timeout=10.0).text)

    def complete(self, **body) -> dict:
        response = httpx.post(f"{self.url}/v1/completions", json={"model": self.model, **body}, timeout=120.0)
        assert response.status_code == 200, response.text
        return response.json()

    def core_pid(self) -> int:
        with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as handle:
            children = handle.read().split()
        for pid in map(int, children):
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if b"spawn_main" in handle.read():
                    return pid
        raise RuntimeError(f"no engine-core child among {children}")


class Prometheus(Process):
    """The Debian `prometheus` binary with a generated config; `query` runs instant PromQL."""

    def __init__(self, log_dir: str, targets: dict[str, str]):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the `prometheus` binary is missing: run scripts/install-test-deps.sh (make test does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(log_dir, "prometheus.yml")
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
                       for job, target in targets.items())
        with open(config, "w") as handle:
            handle.write(f"global:\n  scrape_interval: {int(SCRAPE_INTERVAL_S * 1000)}ms\n"
                         f"  scrape_timeout: {int(SCRAPE_INTERVAL_S * 1000)}ms\nscrape_configs:\n{jobs}")
        command = [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
                   f"--storage.tsdb.path={os.path.join(log_dir, 'tsdb')}", "--log.level=warn"]
        super().__init__("prometheus", command, log_dir)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        response = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10.0)
        body = response.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    def targets_up(self, count: int) -> bool:
        active = httpx.get(f"{self.url}/api/v1/targets", timeout=5.0).json()["data"]["activeTargets"]
        return sum(t["health"] == "up" for t in active) >= count
