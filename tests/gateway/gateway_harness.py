"""Real processes on 127.0.0.1 for the gateway and chaos tests: `lockstep serve random:tiny` engines and
`lockstep gateway` processes, what both suites' fixtures are made of (`running_engines`, `gateway_starter`;
each conftest picks the scope and names), plus a small stdlib HTTP server for failures a real engine cannot
produce on demand. Every wait polls with a deadline; nothing sleeps to synchronise."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from lockstep_gateway.metrics import engine_id

MODEL = "random:tiny"
REPO = Path(__file__).resolve().parents[2]
ENGINE_START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, check: Callable[[], object], timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, OSError, ValueError) as error:
            last = error
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    if int(handle.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


class Process:
    """A child process with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "LOCKSTEP_CPU_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


class Engine(Process):
    def __init__(self, name: str, log_dir: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [
            sys.executable, "-m", "lockstep.cli", "serve", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "256", "--shutdown-grace-period", "1",
        ], log_dir)

    def healthy(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"engine {self.name} exited:\n{self.log_tail()}")
        return httpx.get(self.url + "/health", timeout=2).status_code == 200

    def wait_healthy(self) -> None:
        wait_for(f"engine {self.name} /health", self.healthy, timeout=ENGINE_START_TIMEOUT_S, interval=0.2)

    def kill(self) -> None:
        """kill -9 the API server and its engine core (a dead pod)."""
        assert self.process is not None
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True,
                              check=False).stdout.split()
        self.process.kill()
        self.process.wait(timeout=10)
        for pid in children:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


class Gateway(Process):
    def __init__(self, name: str, log_dir: Path, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [sys.executable, "-m", "lockstep.cli", "gateway", "--host", "127.0.0.1",
                                "--port", str(self.port), "--health-check-interval", "0.2",
                                "--metrics-interval", "0.2", *args], log_dir)

    def answers(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"gateway exited:\n{self.log_tail()}")
        return httpx.get(self.url + "/health", timeout=2).status_code == 200

    def engines(self) -> dict[str, dict]:
        body = httpx.get(self.url + "/gateway/engines", timeout=5, headers=self.headers).json()
        return {e["url"]: e for e in body["engines"]}

    headers: dict[str, str] = {}

    def wait_engines(self, healthy: set[str], timeout: float = 30.0) -> None:
        def ready():
            if not self.alive():
                raise RuntimeError(f"gateway exited:\n{self.log_tail()}")
            return {url for url, e in self.engines().items() if e["healthy"]} == healthy

        try:
            wait_for(f"gateway to see exactly {sorted(healthy)} healthy", ready, timeout=timeout)
        except AssertionError as error:
            raise AssertionError(f"{error}\nengines: {self.engines()}\ngateway log:\n{self.log_tail()}") from None

    def metric(self, name: str, **labels: str) -> float:
        if "engine" in labels:  # the series carry the engine's id, not its URL
            labels["engine"] = engine_id(labels["engine"])
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.contextmanager
def running_engines(names: list[str], log_dir: Path) -> Iterator[list[Engine]]:
    """Real engines, started together and healthy; stopped on exit (a test that kills one starts it again)."""
    engines = [Engine(name, log_dir) for name in names]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@contextlib.contextmanager
def gateway_starter(log_dir: Path) -> Iterator[Callable[..., Gateway]]:
    """`start(*args, expect_healthy=, env_headers=)`: a gateway answering /health (and seeing exactly the
    `expect_healthy` engines healthy; `env_headers` go with its own /gateway requests); every gateway
    started is stopped on exit."""
    started: list[Gateway] = []

    def start(*args: str, expect_healthy: set[str] | None = None, env_headers: dict | None = None) -> Gateway:
        gateway = Gateway(f"gateway-{len(started)}-{time.monotonic_ns()}", log_dir, list(args))
        gateway.headers = env_headers or {}
        gateway.start()
        started.append(gateway)
        wait_for("gateway /health", gateway.answers, timeout=30)
        if expect_healthy is not None:
            gateway.wait_engines(expect_healthy)
        return gateway

    try:
        yield start
    finally:
        for gateway in started:
            gateway.stop()


def start_up(model: str, port: int, log_path: Path, *args: str) -> subprocess.Popen:
    """`lockstep up MODEL --port PORT ARGS` (engines with a 64 MiB KV cache, one CPU thread each), its output in
    `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "lockstep.cli", "up", model, "--port", str(port),
                                 "--kv-cache-memory-bytes", str(64 << 20), *args], stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO, env={**os.environ, "LOCKSTEP_CPU_THREADS": "1"})


def wait_up(up: subprocess.Popen, url: str, log_path: Path, engines: int, timeout: float) -> None:
    """Until the gateway of `up` at `url` sees `engines` healthy engines (failing at once if `up` exits)."""
    def ready():
        assert up.poll() is None, log_path.read_text()
        return httpx.get(url + "/health", timeout=2).json()["healthy_engines"] == engines

    wait_for(f"{engines} engine(s) behind the gateway", ready, timeout=timeout, interval=0.2)


# ---- a fake engine for failures on demand ------------------------------------------------------
class FakeEngine:
    """An OpenAI-shaped server that answers /health, /v1/models and /metrics like an engine and
    misbehaves on POST as told: `hang` (never answers), `status:N` (an error), `status:503:retryable`
    (the engine's "refused before accepting" 503), `reset` (reads the request, then drops the
    connection), or `ok` (one SSE event + DONE). `GET /fake/posts` counts the POSTs.

    LoRA, as a vLLM engine shows it, changed at run time by assigning the attributes: `adapters` (name ->
    path) are listed in /v1/models after the models, `parent` the first model; with `max_loras` above 0,
    /metrics has `vllm:lora_requests_info` with `running_adapters` and `waiting_adapters`, every label set
    once exported kept with the time it was last set (as vLLM's Prometheus client keeps them).
    `num_running` and `num_waiting` are the load /metrics reports."""

    def __init__(self, models: list[str], behaviour: str = "hang", host: str = "127.0.0.1",
                 adapters: dict[str, str] | None = None, max_loras: int = 0):
        self.models = models
        self.behaviour = behaviour
        self.num_posts = 0
        self.posted_models: list[str] = []  # the `model` of each POST, in order
        self.adapters = dict(adapters or {})
        self.max_loras = max_loras
        self.running_adapters: list[str] = []
        self.waiting_adapters: list[str] = []
        self.num_running = 0
        self.num_waiting = 0
        self._lora_series: dict[str, float] = {}  # label set -> when it was last set
        self.release = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                # No keep-alive: once the fake is shut down, nothing answers on an old connection.
                self.close_connection = True
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.send_header("connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, b"{}")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": fake.model_cards()}).encode())
                elif self.path == "/metrics":
                    self._send(200, fake.metrics_text().encode(), "text/plain")
                elif self.path == "/fake/posts":
                    self._send(200, str(fake.num_posts).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with contextlib.suppress(ValueError, AttributeError):
                    fake.posted_models.append(json.loads(body).get("model"))
                fake.num_posts += 1
                if fake.behaviour == "hang":
                    fake.release.wait(60)
                    self.close_connection = True
                elif fake.behaviour == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif fake.behaviour.startswith("status:"):
                    status = int(fake.behaviour.split(":")[1])
                    self.close_connection = True
                    body = json.dumps({"error": {"message": "fake failure: Traceback (most recent call last)",
                                                 "code": status}}).encode()
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.send_header("connection", "close")
                    if fake.behaviour.endswith(":retryable"):
                        self.send_header("x-lockstep-retryable", "overloaded")
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    event = json.dumps({"model": fake.models[0], "choices": [{"index": 0, "text": "fake"}]})
                    self._send(200, f"data: {event}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def model_cards(self) -> list[dict]:
        cards = [{"id": m, "object": "model", "owned_by": "lockstep"} for m in self.models]
        return cards + [{"id": name, "object": "model", "owned_by": "lockstep", "root": path,
                         "parent": self.models[0]} for name, path in dict(self.adapters).items()]

    def metrics_text(self) -> str:
        text = f"vllm:num_requests_running {self.num_running}\nvllm:num_requests_waiting {self.num_waiting}\n"
        if not self.max_loras:
            return text
        labels = (f'max_lora="{self.max_loras}",running_lora_adapters="{",".join(sorted(self.running_adapters))}",'
                  f'waiting_lora_adapters="{",".join(sorted(self.waiting_adapters))}"')
        self._lora_series[labels] = time.time()
        return text + "".join(f"vllm:lora_requests_info{{{labels}}} {at!r}\n"
                              for labels, at in list(self._lora_series.items()))

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
