"""The model fetcher (fetch.py from the engine ConfigMap, the `fetch-model` init container), run by
a real python3 against loopback HTTP servers: a hub that speaks the Hugging Face hub's API
(`/api/models/<repo>/revision/<rev>`, `/<repo>/resolve/<rev>/<file>`, redirects to storage on
another host:port, as the hub does) and a plain file server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback_http import RecordingServer, tarball

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


@pytest.fixture
def hub() -> Iterator[tuple[RecordingServer, RecordingServer]]:
    storage = RecordingServer(lambda path, headers: (200, {}, FILES[path.split("/", 2)[2]]))

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

    server = RecordingServer(handle)
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


def test_a_url_archive_is_unpacked_after_a_server_error_is_retried(tmp_path):
    archive = tarball({"config.json": b"{}", "model.safetensors": b"weights"})
    failures = [503]

    def handle(path: str, headers) -> tuple[int, dict, bytes]:  # type: ignore[no-untyped-def]
        if failures:
            return failures.pop(), {}, b"busy"
        return (200, {}, archive) if path == "/models/tiny.tar.gz" else (404, {}, b"")

    server = RecordingServer(handle)
    try:
        result = fetch(tmp_path, f"{server.url}/models/tiny.tar.gz")
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    assert "HTTP 503; retrying" in result.stderr
    target = tmp_path / "models" / "m"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_an_archive_that_writes_outside_the_model_directory_is_refused(tmp_path):
    archive = tarball({"../../escape": b"x"})
    server = RecordingServer(lambda path, headers: (200, {}, archive))
    try:
        result = fetch(tmp_path, f"{server.url}/evil.tar.gz")
    finally:
        server.close()
    assert result.returncode == 1
    assert "refusing archive member '../../escape'" in result.stderr
    assert not (tmp_path / "escape").exists() and not (tmp_path / "models" / "m").exists()
