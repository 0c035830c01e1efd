"""`spec.lora` and `spec.loraAdapters`: the engine flags and volumes the operator renders, the adapter list it
writes into the engine ConfigMap (never into the pod template, so the list changes without a restart), the
in-pod `lora_sync.py` that fetches adapters and loads them through the engine's run-time routes, and the
CRD's rules on a real kube-apiserver."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from k8s_harness import EXAMPLE, free_port, wait_for
from loopback_http import LoopbackHTTP, QuietHandler, RecordingServer, static_files, tarball
from lockstep_engine.entrypoints.serve import build_parser
from lockstep_operator import builders, plan, pods
from lockstep_operator.config import OperatorConfig
from lockstep_operator.inpod import FETCHER, LAUNCHER, LORA_SYNC
from lockstep_operator.spec import SpecError, parse_spec

IMAGE = "registry.example/lockstep:9.9.9"
CONFIG = OperatorConfig()
OWNER = {"metadata": {"name": "llama", "namespace": "prod", "uid": "uid-1"}}
ADAPTER_FILES = {"adapter_config.json": b'{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}',
                 "adapter_model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "}


def _spec(adapters: list[dict[str, Any]] | None = None, lora: dict[str, Any] | None = None, **more: Any):
    raw: dict[str, Any] = {"model": {"source": "pvc://models/llama-3-8b"}, **more}
    if adapters is not None:
        raw["loraAdapters"] = adapters
    if lora is not None:
        raw["lora"] = lora
    return parse_spec("llama", raw, default_image=IMAGE)


def _engine(spec) -> dict[str, Any]:
    return pods.group_statefulset(OWNER, spec, 0, CONFIG)["spec"]["template"]["spec"]["containers"][0]


def _adapters_in_configmap(spec) -> list[dict[str, str]]:
    return json.loads(builders.engine_configmap(OWNER, spec)["data"]["lora-adapters.json"])["adapters"]


# --- what the operator renders ---------------------------------------------------------------------------


def test_lora_settings_become_the_engine_flags_lockstep_serve_parses():
    args = pods.engine_args(_spec([{"name": "sql", "source": "hf://acme/sql-lora"}], {"maxLoras": 4, "maxLoraRank": 64}))
    assert args[args.index("--enable-lora"):][:7] == [
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "64"]
    assert "--lora-modules" not in args  # the adapters are loaded at run time, from the ConfigMap's list
    parsed = build_parser().parse_args(args)
    assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank, parsed.max_cpu_loras) == (True, 4, 64, 64)


def test_adapters_alone_turn_lora_on_with_vllms_defaults():
    args = pods.engine_args(_spec([{"name": "sql", "source": "hf://acme/sql-lora"}]))
    assert args[args.index("--enable-lora"):][:7] == [
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--max-cpu-loras", "64"]


def test_without_lora_there_is_no_flag_no_list_and_no_sync():
    spec = _spec()
    assert spec.lora is None and "--enable-lora" not in pods.engine_args(spec)
    assert "lora-adapters.json" not in builders.engine_configmap(OWNER, spec)["data"]
    env = {e["name"] for e in _engine(spec)["env"]}
    assert "LOCKSTEP_LORA_ADAPTERS_FILE" not in env and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def test_the_configmap_lists_every_adapter_with_its_path_in_the_pod():
    spec = _spec([{"name": "sql", "source": "hf://acme/sql-lora@v2"},
                  {"name": "chat", "source": "pvc://adapters/chat/v1"},
                  {"name": "legal", "source": "https://files.example/legal.tar.gz?sig=1"}])
    adapters = {a["name"]: a for a in _adapters_in_configmap(spec)}
    assert adapters["chat"] == {"name": "chat", "source": "pvc://adapters/chat/v1", "path": "/models/adapters/chat/v1"}
    assert adapters["sql"]["path"].startswith("/var/cache/lockstep/lora-adapters/")
    assert adapters["legal"]["path"].startswith("/var/cache/lockstep/lora-adapters/")
    assert adapters["sql"]["path"] != adapters["legal"]["path"]
    assert [a["name"] for a in _adapters_in_configmap(spec)] == ["chat", "legal", "sql"]


def test_the_engine_container_may_load_adapters_at_run_time_from_the_mounted_list():
    engine = _engine(_spec([{"name": "sql", "source": "hf://acme/sql-lora"}]))
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert env["LOCKSTEP_LORA_ADAPTERS_FILE"] == "/etc/lockstep/lora-adapters.json"
    assert {"name": "launcher", "mountPath": "/etc/lockstep", "readOnly": True} in engine["volumeMounts"]
    assert "subPath" not in json.dumps(engine["volumeMounts"])  # a subPath mount is never refreshed by the kubelet


def test_pvc_adapters_mount_their_claims_read_only_once_each():
    spec = _spec([{"name": "a", "source": "pvc://adapters/a"}, {"name": "b", "source": "pvc://adapters/b"},
                  {"name": "c", "source": "pvc://models/c"}])
    pod = pods.group_statefulset(OWNER, spec, 0, CONFIG)["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "models", "readOnly": True}, {"claimName": "adapters", "readOnly": True}]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/models/adapters"]["readOnly"] is True and mounts["/models/models"]["readOnly"] is True


def test_hf_adapters_use_the_models_endpoint_and_token():
    spec = _spec([{"name": "sql", "source": "hf://acme/sql-lora"}], model={
        "source": "smollm2", "endpoint": "http://hub.internal", "tokenSecret": {"name": "hf"}})
    engine = _engine(spec)
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["LOCKSTEP_LORA_HF_ENDPOINT"] == "http://hub.internal"
    assert env["LOCKSTEP_MODEL_TOKEN_FILE"] == "/var/run/lockstep/model-token/token"
    assert {"name": "model-token", "mountPath": "/var/run/lockstep/model-token", "readOnly": True} in engine["volumeMounts"]


def test_the_configmap_carries_lora_sync_as_it_is_in_the_package():
    inpod = Path(builders.__file__).parent / "inpod"
    data = builders.engine_configmap(OWNER, _spec())["data"]
    assert data["lora_sync.py"] == (inpod / "lora_sync.py").read_text(encoding="utf-8")


def test_lora_sync_imports_only_the_standard_library():
    tree = ast.parse(LORA_SYNC)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or ".").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


# --- the adapter list never restarts a group, unless the pods need a new volume ----------------------------


BEFORE = [{"name": "sql", "source": "hf://acme/sql-lora@v1"}, {"name": "chat", "source": "pvc://adapters/chat"}]


@pytest.mark.parametrize("after", [
    [*BEFORE, {"name": "legal", "source": "https://files.example/legal.tgz"}],
    BEFORE[1:],
    [{"name": "sql", "source": "hf://acme/sql-lora@v2"}, BEFORE[1]],
    [*BEFORE, {"name": "chat-v2", "source": "pvc://adapters/chat-v2"}],
    list(reversed(BEFORE)),
], ids=["add-url", "remove-hf", "new-revision", "same-claim", "reordered"])
def test_a_run_time_loadable_change_leaves_the_pod_template_alone(after):
    before, changed = _spec(BEFORE), _spec(after)
    old = pods.group_statefulset(OWNER, before, 0, CONFIG)["spec"]["template"]
    new = pods.group_statefulset(OWNER, changed, 0, CONFIG)["spec"]["template"]
    assert new == old and pods.revision(changed, "prod", CONFIG) == pods.revision(before, "prod", CONFIG)
    if after != list(reversed(BEFORE)):
        assert _adapters_in_configmap(changed) != _adapters_in_configmap(before)


def test_an_adapter_on_a_new_claim_rolls_the_groups():
    changed = _spec([*BEFORE, {"name": "med", "source": "pvc://medical/lora"}])
    assert pods.revision(changed, "prod", CONFIG) != pods.revision(_spec(BEFORE), "prod", CONFIG)


def test_removing_a_claims_last_adapter_rolls_the_groups():
    assert pods.revision(_spec(BEFORE[:1]), "prod", CONFIG) != pods.revision(_spec(BEFORE), "prod", CONFIG)


# --- the operator's own checks, naming the field -----------------------------------------------------------


@pytest.mark.parametrize("adapters, lora, field, words", [
    ([{"name": "SQL", "source": "hf://a/b"}], None, "spec.loraAdapters[0].name", "lowercase letters"),
    ([{"name": "sql", "source": "hf://a/b"}, {"name": "sql", "source": "hf://a/c"}], None,
     "spec.loraAdapters[1].name", "listed twice"),
    ([{"name": "llama", "source": "hf://a/b"}], None, "spec.loraAdapters[0].name", "served model name"),
    ([{"name": "sql", "source": "/adapters/sql"}], None, "spec.loraAdapters[0].source", "pvc://<claim>/<path>"),
    ([{"name": "sql", "source": "hf://just-a-repo"}], None, "spec.loraAdapters[0].source", "hf://<org>/<repo>"),
    ([{"name": "sql", "source": "pvc://Bad_Claim/x"}], None, "spec.loraAdapters[0].source", "pvc://<claim-name>"),
    ([{"name": "sql", "source": "https://files.example/adapter_model.safetensors"}], None,
     "spec.loraAdapters[0].source", "archive"),
    ([{"name": "sql", "source": "hf://a/b", "rank": 8}], None, "spec.loraAdapters[0].rank", "not a field"),
    ([{"name": "sql"}], None, "spec.loraAdapters[0].source", "got None"),
    ([{"name": f"a{i}", "source": "hf://a/b"} for i in range(65)], None, "spec.loraAdapters", "at most 64"),
    (None, {"maxLoraRank": 24}, "spec.lora.maxLoraRank", "one of 1, 8, 16, 32, 64, 128, 256, 320, 512, got 24"),
    (None, {"maxLoras": 0}, "spec.lora.maxLoras", "an integer in 1..64, got 0"),
    (None, {"maxCpuLoras": 4}, "spec.lora.maxCpuLoras", "not a field"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(adapters, lora, field, words):
    with pytest.raises(SpecError) as error:
        _spec(adapters, lora)
    assert error.value.field == field and words in str(error.value), str(error.value)


def test_an_invalid_adapter_is_reported_in_status_naming_the_field():
    """An object the API server stored anyway (e.g. under an older CRD) is Ready=False, InvalidSpec."""
    owner = {"apiVersion": "serving.lockstep.dev/v1alpha1", "kind": "LLMService",
             "metadata": {**OWNER["metadata"], "generation": 3},
             "spec": {"model": {"source": "smollm2"}, "loraAdapters": [{"name": "Sql", "source": "hf://a/b"}]}}
    result = plan.plan_reconcile(owner, plan.Observed(), CONFIG, "2026-12-01T00:00:00Z")
    ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and not result.apply
    assert ready["message"].startswith("spec.loraAdapters[0].name: must be at most 63 lowercase letters") and "'Sql'" in ready["message"]


@pytest.mark.parametrize("flag", ["--enable-lora", "--max-loras=2", "--max-lora-rank", "--max-cpu-loras", "--lora-modules"])
def test_extra_args_may_not_set_the_lora_flags(flag):
    with pytest.raises(SpecError) as error:
        _spec(engine={"extraArgs": [flag, "1"]})
    assert flag.split("=")[0] in str(error.value)


# --- lora_sync.py against a real HTTP server standing in for the engine ------------------------------------


class FakeEngine(LoopbackHTTP):
    """The engine's /health, /v1/models and LoRA routes on loopback: loads succeed for directories with an
    adapter_config.json (else 400, as the engine refuses a malformed adapter), unloads of unknown names 404."""

    def __init__(self, preloaded: dict[str, str] | None = None, api_key: str | None = None) -> None:
        self.adapters: dict[str, str] = dict(preloaded or {})
        self.calls: list[tuple[str, dict]] = []
        self.authorizations: list[str | None] = []
        self.healthy = threading.Event()
        self.healthy.set()
        outer = self

        class Handler(QuietHandler):
            def reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/health":
                    self.reply(200 if outer.healthy.is_set() else 503, b"")
                    return
                models = [{"id": "llama", "root": "/models/llama", "parent": None}]
                models += [{"id": n, "root": p, "parent": "llama"} for n, p in outer.adapters.items()]
                self.reply(200, json.dumps({"object": "list", "data": models}).encode())

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append((self.path, body))
                outer.authorizations.append(self.headers.get("Authorization"))
                name = body["lora_name"]
                if self.path == "/v1/load_lora_adapter":
                    if name in outer.adapters:
                        self.reply(400, f"The lora adapter '{name}' has already been loaded.".encode())
                    elif not os.path.isfile(os.path.join(body["lora_path"], "adapter_config.json")):
                        self.reply(400, f"no adapter_config.json in {body['lora_path']}".encode())
                    else:
                        outer.adapters[name] = body["lora_path"]
                        self.reply(200, f"Success: LoRA adapter '{name}' added successfully.".encode())
                elif name in outer.adapters:
                    del outer.adapters[name]
                    self.reply(200, f"Success: LoRA adapter '{name}' removed successfully.".encode())
                else:
                    self.reply(404, f"The lora adapter '{name}' cannot be found.".encode())

        self.start(Handler)


def _hub_files(repo: str, revision: str) -> dict[str, tuple[str, bytes]]:
    siblings = json.dumps({"siblings": [{"rfilename": name} for name in ADAPTER_FILES]}).encode()
    files = {f"/api/models/{repo}/revision/{revision}": ("application/json", siblings)}
    files.update({f"/{repo}/resolve/{revision}/{name}": ("application/octet-stream", data) for name, data in ADAPTER_FILES.items()})
    return files


@pytest.fixture
def inpod(tmp_path: Path):
    """The in-pod programs as the ConfigMap mounts them: lora_sync.py beside fetch.py (it runs fetch.py)."""
    directory = tmp_path / "etc-lockstep"
    directory.mkdir()
    (directory / "fetch.py").write_text(FETCHER)
    (directory / "lora_sync.py").write_text(LORA_SYNC)
    (directory / "launch.py").write_text(LAUNCHER)
    module_spec = importlib.util.spec_from_file_location("lora_sync_under_test", directory / "lora_sync.py")
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    module.directory = directory  # type: ignore[attr-defined]
    return module


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    server = FakeEngine(api_key="sk-test")
    yield server
    server.close()


def _write_list(path: Path, adapters: list[dict[str, str]]) -> None:
    """As the kubelet updates a ConfigMap volume: the new file appears whole, by a rename."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"adapters": adapters}))
    partial.replace(path)


def _local_adapter(directory: Path) -> str:
    directory.mkdir(parents=True)
    for name, data in ADAPTER_FILES.items():
        (directory / name).write_bytes(data)
    return str(directory)


def _sync(inpod, tmp_path: Path, engine: FakeEngine | None, **env: str):
    client = None if engine is None else inpod.Engine(engine.url, "sk-test", timeout=10)
    return inpod.AdapterSync(str(tmp_path / "lora-adapters.json"), client, str(inpod.directory / "fetch.py"),
                             {"PATH": os.environ["PATH"], **env})


def test_the_leader_fetches_hf_adapters_and_loads_every_listed_one(inpod, engine, tmp_path):
    hub = RecordingServer(static_files(_hub_files("acme/sql-lora", "v1")))
    token = tmp_path / "token"
    token.write_text("hf_secret\n")
    fetched = tmp_path / "cache" / "sql"
    chat = _local_adapter(tmp_path / "claim" / "chat")
    _write_list(tmp_path / "lora-adapters.json", [
        {"name": "sql", "source": "hf://acme/sql-lora@v1", "path": str(fetched)},
        {"name": "chat", "source": "pvc://claim/chat", "path": chat},
    ])
    try:
        assert _sync(inpod, tmp_path, engine, HF_ENDPOINT=hub.url, LOCKSTEP_MODEL_TOKEN_FILE=str(token)).sync_once()
    finally:
        hub.close()
    assert engine.adapters == {"sql": str(fetched), "chat": chat}
    assert sorted(p for p, _ in engine.calls) == ["/v1/load_lora_adapter"] * 2
    assert set(engine.authorizations) == {"Bearer sk-test"}  # the engine's API key guards /v1/*
    assert (fetched / "adapter_config.json").read_bytes() == ADAPTER_FILES["adapter_config.json"]
    assert {auth for _, auth in hub.requests} == {"Bearer hf_secret"}


def test_removed_adapters_are_unloaded_and_their_fetched_files_removed(inpod, engine, tmp_path):
    archive = RecordingServer(static_files({"/legal.tar.gz": ("application/gzip", tarball(ADAPTER_FILES))}))
    listed = tmp_path / "lora-adapters.json"
    fetched = tmp_path / "cache" / "legal"
    _write_list(listed, [{"name": "legal", "source": f"{archive.url}/legal.tar.gz", "path": str(fetched)}])
    sync = _sync(inpod, tmp_path, engine)
    try:
        assert sync.sync_once()
    finally:
        archive.close()
    assert engine.adapters == {"legal": str(fetched)} and fetched.is_dir()
    _write_list(listed, [])
    assert sync.sync_once()
    assert engine.adapters == {} and engine.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": "legal"})
    assert not fetched.exists()


def test_an_adapter_whose_path_changed_is_unloaded_then_loaded_again(inpod, engine, tmp_path):
    listed = tmp_path / "lora-adapters.json"
    v1, v2 = _local_adapter(tmp_path / "claim" / "v1"), _local_adapter(tmp_path / "claim" / "v2")
    _write_list(listed, [{"name": "sql", "source": "pvc://claim/v1", "path": v1}])
    sync = _sync(inpod, tmp_path, engine)
    assert sync.sync_once()
    _write_list(listed, [{"name": "sql", "source": "pvc://claim/v2", "path": v2}])
    assert sync.sync_once()
    assert engine.calls[1:] == [("/v1/unload_lora_adapter", {"lora_name": "sql"}),
                                ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": v2})]
    assert engine.adapters == {"sql": v2}


def test_a_refused_adapter_is_tried_again_on_the_next_pass(inpod, engine, tmp_path):
    listed = tmp_path / "lora-adapters.json"
    missing = tmp_path / "claim" / "late"
    _write_list(listed, [{"name": "late", "source": "pvc://claim/late", "path": str(missing)}])
    sync = _sync(inpod, tmp_path, engine)
    assert sync.sync_once()
    assert engine.adapters == {} and len(engine.calls) == 1
    _local_adapter(missing)
    assert sync.sync_once()
    assert engine.adapters == {"late": str(missing)}


def test_adapters_the_engine_already_has_are_not_loaded_twice(inpod, tmp_path):
    """A restarted lora_sync.py (the engine kept running) learns the loaded adapters from /v1/models."""
    kept = _local_adapter(tmp_path / "claim" / "kept")
    engine = FakeEngine(preloaded={"kept": kept, "gone": "/models/claim/gone"})
    try:
        _write_list(tmp_path / "lora-adapters.json", [{"name": "kept", "source": "pvc://claim/kept", "path": kept}])
        assert _sync(inpod, tmp_path, engine).sync_once()
    finally:
        engine.close()
    assert engine.calls == [("/v1/unload_lora_adapter", {"lora_name": "gone"})]


def test_nothing_is_loaded_before_the_engine_is_healthy(inpod, engine, tmp_path):
    engine.healthy.clear()
    chat = _local_adapter(tmp_path / "claim" / "chat")
    _write_list(tmp_path / "lora-adapters.json", [{"name": "chat", "source": "pvc://claim/chat", "path": chat}])
    sync = _sync(inpod, tmp_path, engine)
    assert not sync.sync_once() and engine.calls == []
    engine.healthy.set()
    assert sync.sync_once() and engine.adapters == {"chat": chat}


def test_a_worker_pod_fetches_but_never_calls_the_engine(inpod, tmp_path):
    archive = RecordingServer(static_files({"/a.tgz": ("application/gzip", tarball(ADAPTER_FILES))}))
    fetched = tmp_path / "cache" / "a"
    _write_list(tmp_path / "lora-adapters.json", [{"name": "a", "source": f"{archive.url}/a.tgz", "path": str(fetched)}])
    try:
        assert _sync(inpod, tmp_path, None).sync_once()
    finally:
        archive.close()
    assert (fetched / "adapter_model.safetensors").is_file()


# --- the launcher runs lora_sync.py beside the engine, and the leader is ready once it has synced ----------

# A stand-in `lockstep serve`: the fake engine's routes on LOCKSTEP_HTTP_PORT, each POST recorded as a line.
STAND_IN = f"""#!{sys.executable}
import http.server, json, os, sys
record, adapters = os.environ["LOCKSTEP_RECORD"], {{}}

class Handler(http.server.BaseHTTPRequestHandler):
    def reply(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        models = [{{"id": n, "root": p, "parent": "base"}} for n, p in adapters.items()]
        self.reply(200, json.dumps({{"data": models}}).encode() if self.path == "/v1/models" else b"ok")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(record, "a") as out:
            out.write(json.dumps([self.path, body]) + "\\n")
        if self.path == "/v1/load_lora_adapter":
            adapters[body["lora_name"]] = body["lora_path"]
        else:
            adapters.pop(body["lora_name"], None)
        self.reply(200, b"Success")

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(os.environ["LOCKSTEP_HTTP_PORT"])), Handler).serve_forever()
"""


def test_the_launcher_keeps_the_leaders_adapters_in_step_with_the_list(inpod, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lockstep").write_text(STAND_IN)
    (bin_dir / "lockstep").chmod(0o755)
    record, listed = tmp_path / "record.jsonl", tmp_path / "lora-adapters.json"
    first, second = _local_adapter(tmp_path / "claim" / "first"), _local_adapter(tmp_path / "claim" / "second")
    _write_list(listed, [{"name": "first", "source": "pvc://claim/first", "path": first}])
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOCKSTEP_RECORD": str(record), "LOCKSTEP_POD_INDEX": "0",
           "LOCKSTEP_HTTP_PORT": str(free_port()), "LOCKSTEP_LORA_ADAPTERS_FILE": str(listed),
           "LOCKSTEP_LORA_READY_FILE": str(tmp_path / "lora-ready"), "LOCKSTEP_LORA_POLL_SECONDS": "0.2",
           "LOCKSTEP_IMAGE_MODELS": str(tmp_path / "none")}
    (tmp_path / "lora-ready").write_text("left by the previous container\n")
    launcher = [sys.executable, str(inpod.directory / "launch.py")]

    def probe() -> int:
        return subprocess.run([*launcher, "--probe"], env=env, capture_output=True, timeout=30).returncode

    def calls() -> list[list[Any]]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    process = subprocess.Popen([*launcher, "base-model"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the first adapter loaded", lambda: len(calls()) == 1, timeout=30)
        assert calls() == [["/v1/load_lora_adapter", {"lora_name": "first", "lora_path": first}]]
        wait_for("the leader ready once the adapters are synced", lambda: probe() == 0, timeout=30)
        _write_list(listed, [{"name": "second", "source": "pvc://claim/second", "path": second}])
        wait_for("the list change applied", lambda: len(calls()) == 3, timeout=30)
        assert calls()[1:] == [["/v1/unload_lora_adapter", {"lora_name": "first"}],
                               ["/v1/load_lora_adapter", {"lora_name": "second", "lora_path": second}]]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert "loaded first" in process.stderr.read()  # type: ignore[union-attr]


def test_a_leader_with_adapters_is_not_ready_before_the_first_sync(inpod, tmp_path):
    env = {"PATH": os.environ["PATH"], "LOCKSTEP_POD_INDEX": "0", "LOCKSTEP_HTTP_PORT": str(free_port()),
           "LOCKSTEP_LORA_ADAPTERS_FILE": str(tmp_path / "lora-adapters.json"),
           "LOCKSTEP_LORA_READY_FILE": str(tmp_path / "absent")}
    done = subprocess.run([sys.executable, str(inpod.directory / "launch.py"), "--probe"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "not loaded yet" in done.stderr


# --- the CRD on a real kube-apiserver --------------------------------------------------------------------


def _manifest(name: str = "lora", **spec: Any) -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"].update(spec)
    return manifest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change, message", [
    ({"loraAdapters": [{"name": "SQL", "source": "hf://acme/sql"}]}, "spec.loraAdapters[0].name: Invalid value"),
    ({"loraAdapters": [{"name": "sql", "source": "hf://acme/a"}, {"name": "sql", "source": "hf://acme/b"}]},
     'spec.loraAdapters[1]: Duplicate value: {"name":"sql"}'),
    ({"loraAdapters": [{"name": "sql", "source": "/adapters/sql"}]},
     "loraAdapters source must be pvc://<claim>/<path>, hf://<org>/<repo>[@<revision>] or an http(s):// URL"),
    ({"loraAdapters": [{"name": "sql", "source": "hf://no-org"}]}, "loraAdapters source must look like hf://"),
    ({"loraAdapters": [{"name": "sql", "source": "pvc://Bad/x"}]}, "loraAdapters source must look like pvc://"),
    ({"loraAdapters": [{"name": "sql", "source": "https://files.example/adapter_model.safetensors"}]},
     "loraAdapters source URLs must name a .tar, .tar.gz or .tgz archive"),
    ({"loraAdapters": [{"name": "sql"}]}, 'spec.loraAdapters[0].source: Required value'),
    ({"loraAdapters": [{"name": "smollm2", "source": "hf://acme/sql"}]},
     "spec.loraAdapters names must differ from the served model name"),
    ({"lora": {"maxLoraRank": 24}}, 'spec.lora.maxLoraRank: Unsupported value: 24'),
    ({"lora": {"maxLoras": 0}}, "spec.lora.maxLoras: Invalid value: 0"),
    ({"engine": {"extraArgs": ["--max-loras=4"]}}, "nor --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras or --lora-modules: use spec.lora"),
], ids=["name-uppercase", "name-twice", "source-local-path", "source-hf-no-org", "source-pvc-bad-claim",
        "source-url-not-archive", "source-missing", "name-is-the-model", "rank-not-vllms", "max-loras-0",
        "flag-in-extra-args"])
def test_the_api_server_refuses_bad_adapters(release, kubectl, namespace, change, message):
    result = kubectl.apply(_manifest(**change), namespace, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert kubectl.get("llmservices", "-n", namespace)["items"] == []


LORA_EXAMPLE = EXAMPLE.parent / "llmservice-lora.yaml"


def test_the_lora_example_is_a_spec_the_operator_serves():
    manifest = yaml.safe_load(LORA_EXAMPLE.read_text())
    spec = parse_spec(manifest["metadata"]["name"], manifest["spec"], default_image=IMAGE)
    assert spec.lora is not None and [a.name for a in spec.lora.adapters] == ["sql", "legal", "support"]


@pytest.mark.timeout(300)
def test_the_api_server_accepts_the_lora_example(release, kubectl, namespace):
    kubectl.run("apply", "-n", namespace, "-f", str(LORA_EXAMPLE))
    assert kubectl.get("llmservice", "llama-8b", "-n", namespace)["spec"]["lora"] == {"maxLoras": 4, "maxLoraRank": 64}


@pytest.mark.timeout(300)
def test_the_api_server_accepts_adapters_and_fills_the_lora_defaults(release, kubectl, namespace):
    adapters = [{"name": "sql-v1.2", "source": "hf://acme/sql-lora@v1"},
                {"name": "chat_en", "source": "pvc://adapters/chat"},
                {"name": "legal", "source": "https://files.example/legal.tar.gz?X-Amz-Signature=abc"}]
    kubectl.apply(_manifest(lora={}, loraAdapters=adapters), namespace)
    spec = kubectl.get("llmservice", "lora", "-n", namespace)["spec"]
    assert spec["lora"] == {"maxLoras": 1, "maxLoraRank": 16} and spec["loraAdapters"] == adapters
    assert "loraAdapters" in kubectl.run("explain", "llmservice.spec").stdout


@pytest.mark.timeout(300)
def test_an_adapter_list_change_reaches_the_configmap_and_leaves_the_statefulset_alone(operator, kubectl, namespace):
    kubectl.apply(_manifest(loraAdapters=[{"name": "sql", "source": "hf://acme/sql-lora@v1"}]), namespace)
    sts = wait_for("StatefulSet lora-g0", lambda: kubectl.get("statefulsets", "-n", namespace)["items"])[0]
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    assert engine["args"][engine["args"].index("--enable-lora"):][:5] == [
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16"]

    def listed() -> list[str]:
        data = kubectl.get("configmap", "lora-engine", "-n", namespace)["data"]
        return [a["name"] for a in json.loads(data.get("lora-adapters.json", '{"adapters": []}'))["adapters"]]

    wait_for("the first list in the ConfigMap", lambda: listed() == ["sql"])
    kubectl.apply(_manifest(loraAdapters=[{"name": "sql", "source": "hf://acme/sql-lora@v2"},
                                          {"name": "legal", "source": "https://files.example/legal.tgz"}]), namespace)
    wait_for("the new list in the ConfigMap", lambda: listed() == ["legal", "sql"])
    after = kubectl.get("statefulset", sts["metadata"]["name"], "-n", namespace)
    assert after["metadata"]["generation"] == sts["metadata"]["generation"]
    assert after["spec"]["template"] == sts["spec"]["template"]


# --- the real engine, started by the launcher, with lora_sync.py beside it ---------------------------------


def _peft_adapter(directory: Path, rank: int, seed: int) -> str:
    """A PEFT adapter of random:tiny's q_proj (4 layers, hidden 128, 8 heads of 16)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(4):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 128, generator=generator) * 0.1
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(128, rank, generator=generator) * 0.1
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def test_the_real_engine_serves_the_listed_adapters_and_follows_the_list(inpod, tmp_path):
    import openai

    from lockstep_operator.lora import engine_args as lora_args

    first = _peft_adapter(tmp_path / "claim" / "first", rank=8, seed=1)
    second = _peft_adapter(tmp_path / "claim" / "second", rank=8, seed=2)
    too_big = _peft_adapter(tmp_path / "claim" / "big", rank=32, seed=3)
    listed = tmp_path / "lora-adapters.json"
    _write_list(listed, [{"name": "first", "source": "pvc://claim/first", "path": first},
                         {"name": "big", "source": "pvc://claim/big", "path": too_big}])
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "LOCKSTEP_POD_INDEX": "0",
           "LOCKSTEP_HTTP_PORT": str(port), "LOCKSTEP_CACHE": str(tmp_path / "cache"),
           "LOCKSTEP_IMAGE_MODELS": str(tmp_path / "none"), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
           "LOCKSTEP_LORA_ADAPTERS_FILE": str(listed), "LOCKSTEP_LORA_READY_FILE": str(tmp_path / "lora-ready"),
           "LOCKSTEP_LORA_POLL_SECONDS": "0.2"}
    spec = _spec([{"name": "first", "source": "pvc://claim/first"}], {"maxLoras": 1, "maxLoraRank": 16})
    assert spec.lora is not None
    launcher = [sys.executable, str(inpod.directory / "launch.py")]
    log = (tmp_path / "pod.log").open("w")
    pod = subprocess.Popen(
        [*launcher, "random:tiny", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
         "--num-gpu-blocks-override", "128", "--max-model-len", "512", "--device", "cpu", *lora_args(spec.lora)],
        env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)

    def ready() -> bool:
        assert pod.poll() is None, (tmp_path / "pod.log").read_text()[-3000:]
        return subprocess.run([*launcher, "--probe"], env=env, capture_output=True, timeout=30).returncode == 0

    def models() -> list[str]:
        return [m.id for m in client.models.list().data]

    try:
        wait_for("the leader ready with its adapters", ready, timeout=180)
        assert models() == ["tiny", "first"]  # "big" (rank 32 > --max-lora-rank 16) is refused alone
        completion = client.completions.create(model="first", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert completion.model == "first" and completion.usage.completion_tokens == 4
        _write_list(listed, [{"name": "second", "source": "pvc://claim/second", "path": second}])
        wait_for("the engine to follow the new list", lambda: models() == ["tiny", "second"], timeout=30)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="first", prompt=[1, 2, 3], max_tokens=4)
        pod.send_signal(signal.SIGTERM)
        pod.wait(timeout=60)
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait(timeout=30)
        log.close()
    text = (tmp_path / "pod.log").read_text()
    assert "load big: HTTP 400" in text and "max_lora_rank" in text, text[-3000:]
