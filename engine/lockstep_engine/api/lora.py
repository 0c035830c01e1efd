"""LoRA adapters over HTTP, as vLLM serves them: each registered adapter is a model of its own in
/v1/models (its `parent` is the base model's first served name, its `root` the adapter's path), and a
request names one by its `model`. /v1/load_lora_adapter and /v1/unload_lora_adapter change the list at
run time; as in vLLM they exist only when the server runs with --enable-lora and the environment says
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (a path sent over HTTP is read from this machine's disk)."""

from __future__ import annotations

import os
import uuid

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from lockstep_engine import protocol as p
from lockstep_engine.api.errors import APIError, bad_request

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def model_cards(serving, created: int, root: str) -> list[dict]:
    """The base model's served names, then the registered adapters (vLLM's /v1/models entries)."""
    max_len = serving.config.max_model_len
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "lockstep", "root": root,
              "parent": None, "max_model_len": max_len} for name in serving.served_model_names]
    cards += [{"id": name, "object": "model", "created": created, "owned_by": "lockstep", "root": path,
               "parent": serving.model_name, "max_model_len": max_len} for name, path in serving.client.adapters.items()]
    return cards


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_int_id: int | None = None  # vLLM's; the name alone identifies an adapter here


def register(app: FastAPI, state, error_responses: dict) -> None:
    """Adds the two routes when run-time updates are allowed (`state`: the app's state, as the other routes)."""

    async def call(message) -> PlainTextResponse:
        serving = state.require_serving()
        reply = await serving.client.adapter_call(message)
        if reply.error is not None:
            raise APIError(reply.status, reply.error, "lora_name" if reply.status == 404 else None)
        verb = "added" if isinstance(message, p.LoadAdapter) else "removed"
        return PlainTextResponse(f"Success: LoRA adapter '{message.name}' {verb} successfully.")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name, path = body.lora_name, body.lora_path
        if name in state.require_serving().served_model_names:
            raise bad_request(f"lora_name: {name!r} is a name of the base model", "lora_name")
        if "\x00" in path or not os.path.isabs(path):
            raise bad_request(f"lora_path: expected an absolute directory path, got {path!r}", "lora_path")
        return await call(p.LoadAdapter(uuid.uuid4().hex, name, path))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return await call(p.UnloadAdapter(uuid.uuid4().hex, body.lora_name))
