"""The API-server process never imports torch: only the engine-core process it spawns does.

Importing the API modules is checked in a fresh interpreter; a running server is checked through
/proc, after it has served requests: torch's shared libraries are mapped into the core only.
"""

import json
import subprocess
import sys

from api_harness import REPO, Server

API_MODULES = [
    "lockstep_engine.api.app",
    "lockstep_engine.api.client",
    "lockstep_engine.api.core_launch",
    "lockstep_engine.api.errors",
    "lockstep_engine.api.metrics",
    "lockstep_engine.api.openai_models",
    "lockstep_engine.api.serving",
    "lockstep_engine.entrypoints.serve",
]
# The core's side (packages count with their submodules): none may come along with the API modules.
CORE_MODULES = ("torch", "lockstep_engine.models", "lockstep_engine.kernels", "lockstep_engine.runner",
                "lockstep_engine.engine", "lockstep_engine.engine_core", "lockstep_engine.sources",
                "lockstep_engine.guided")


def _imported_after(code: str) -> list[str]:
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _core_side(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == core or m.startswith(core + ".") for core in CORE_MODULES)]


def test_importing_the_api_modules_imports_no_torch():
    modules = _imported_after("\n".join(f"import {name}" for name in API_MODULES))
    assert set(API_MODULES) <= set(modules)
    assert _core_side(modules) == []


def test_building_the_app_imports_no_torch():
    modules = _imported_after(
        "from lockstep_engine.api.app import ServerSettings, build_app\n"
        "from lockstep_engine.config import EngineConfig\n"
        "app = build_app(EngineConfig(model='random:tiny'), ServerSettings(served_model_names=['tiny']))\n"
        "assert app.state.server.client is None  # the core starts with the app's lifespan, not here")
    assert "fastapi" in modules and _core_side(modules) == []


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as handle:
        return "libtorch" in handle.read()


def _assert_only_the_core_has_torch(server: Server) -> None:
    assert _maps_torch(server.core_pid()), "the engine core should run the model with torch"
    assert not _maps_torch(server.process.pid), "the API-server process has torch loaded"


def test_a_serving_api_process_has_no_torch_loaded(tiny: Server):
    completion = tiny.client().completions.create(model=tiny.model, prompt=[1, 2, 3], max_tokens=4,
                                                  extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4
    _assert_only_the_core_has_torch(tiny)


def test_text_chat_and_guided_json_leave_the_api_process_without_torch(smol8: Server):
    # The tokenizer (pickled over from the core), the chat template and schema compilation all run here.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = smol8.client().chat.completions.create(
        model=smol8.model, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert isinstance(json.loads(chat.choices[0].message.content)["ok"], bool)
    _assert_only_the_core_has_torch(smol8)
