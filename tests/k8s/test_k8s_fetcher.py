"""The model fetcher (fetch.py from the engine ConfigMap, the `fetch-model` init container), run by
a real python3 against loopback HTTP servers: a hub that speaks the Hugging Face hub's API
(`/api/models/<repo>/revision/<rev>`, `/<repo>/resolve/<rev>/<file>`, redirects to storage on
another host:port, as the hub does) and a plain file server."""

from __future__ import annotations

import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep_operator.inpod import FETCHER

REPO = "HuggingFaceTB/Tiny"
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": os.urandom(300_000),
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"not needed to serve",
    "onnx/model.onnx": b"not at the top level",
}
TOKEN = "hf_test_token"


class Server:
    """A loopback HTTP server recording every request (path, Authorization header)."""

    def __init__(self, handle) -> None:  # type: ignore[no-untyped-def]
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.requests.append((self.path, self.headers.get("Authorization")))
                status, headers, body = handle(self.path, self.headers)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hub() -> Iterator[tuple[Server, Server]]:
    storage = Server(lambda path, headers: (200, {}, FILES[path.split("/", 2)[2]]))

    def handle(path: str, headers) -> tuple[int, dict, bytes]:  # type: ignore[no-untyped-def]
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, {}, b"gated repo"
        if path == f"/api/models/{REPO}/revision/v1":
            siblings = [{"rfilename": name} for name in FILES]
            return 200, {"Content-Type": "application/json"}, json.dumps({"siblings": siblings}).encode()
        prefix = f"/{REPO}/resolve/v1/"
        if path.startswith(prefix) and path[len(prefix) :] in FILES:
            return 302, {"Location": f"{storage.url}/blob/{path[len(prefix):]}"}, b""
        return 404, {}, b"no such file"

    server = Server(handle)
    yield server, storage
    server.close()
    storage.close()


def fetch(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "fetch.py"
    script.write_text(FETCHER)
    full_env = {
        "PATH": os.environ["PATH"],
        "LOCKSTEP_MODEL_SOURCE": source,
        "LOCKSTEP_MODEL_DIR": str(tmp_path / "models" / "m"),
        **env,
    }
    return subprocess.run([sys.executable, str(script)], env=full_env, capture_output=True, text=True, timeout=60)


def test_an_hf_model_is_fetched_with_its_token_and_kept_for_the_next_start(tmp_path, hub):
    server, storage = hub
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {"HF_ENDPOINT": server.url, "LOCKSTEP_MODEL_TOKEN_FILE": str(token_file)}
    result = fetch(tmp_path, f"hf://{REPO}@v1", **env)
    assert result.returncode == 0, result.stderr
    target = tmp_path / "models" / "m"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (target / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["m"]  # no partial copy left
    # The token goes to the hub only, never to the storage host it redirects to.
    assert all(auth == f"Bearer {TOKEN}" for _, auth in server.requests)
    assert storage.requests and all(auth is None for _, auth in storage.requests)

    hub_requests = len(server.requests)
    again = fetch(tmp_path, f"hf://{REPO}@v1", **env)
    assert again.returncode == 0
    assert "already in" in again.stderr
    assert len(server.requests) == hub_requests  # a cache volume: nothing fetched twice


def test_a_gated_model_without_a_token_fails_with_the_status(tmp_path, hub):
    server, _ = hub
    result = fetch(tmp_path, f"hf://{REPO}@v1", HF_ENDPOINT=server.url)
    assert result.returncode == 1
    assert f"GET {server.url}/api/models/{REPO}/revision/v1: HTTP 401" in result.stderr
    assert list((tmp_path / "models").iterdir()) == []  # neither the model nor a partial copy


def _tarball(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_url_archive_is_unpacked_after_a_server_error_is_retried(tmp_path):
    archive = _tarball({"config.json": b"{}", "model.safetensors": b"weights"})
    failures = [503]

    def handle(path: str, headers) -> tuple[int, dict, bytes]:  # type: ignore[no-untyped-def]
        if failures:
            return failures.pop(), {}, b"busy"
        return (200, {}, archive) if path == "/models/tiny.tar.gz" else (404, {}, b"")

    server = Server(handle)
    try:
        result = fetch(tmp_path, f"{server.url}/models/tiny.tar.gz")
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    assert "HTTP 503; retrying" in result.stderr
    target = tmp_path / "models" / "m"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_an_archive_that_writes_outside_the_model_directory_is_refused(tmp_path):
    archive = _tarball({"../../escape": b"x"})
    server = Server(lambda path, headers: (200, {}, archive))
    try:
        result = fetch(tmp_path, f"{server.url}/evil.tar.gz")
    finally:
        server.close()
    assert result.returncode == 1
    assert "refusing archive member '../../escape'" in result.stderr
    assert not (tmp_path / "escape").exists() and not (tmp_path / "models" / "m").exists()
