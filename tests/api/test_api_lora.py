"""`lockstep serve smollm2 --enable-lora` over HTTP with the official client: adapters are models in
/v1/models, a request names one by `model` and gets transformers + peft's greedy text, adapters load and
unload at run time while other requests stream (none fails or changes), and every bad call is an OpenAI
error naming what is wrong, with the server unharmed."""

from __future__ import annotations

import os
import threading
from unittest import mock

import httpx
import openai
import pytest
from api_harness import Server

pytest.importorskip("peft")

PROMPT = "Once upon a time, in a land far away,"
NEW_TOKENS = 10
FIRST, SECOND = "every-layer", "attention-rs"


@pytest.fixture(scope="module")
def reference(peft_reference):
    return peft_reference


@pytest.fixture(scope="module")
def lora_server(reference):
    with mock.patch.dict(os.environ, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}):
        server = Server("smollm2", "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20),
                        "--enable-lora", "--max-loras", "2", "--lora-modules", f"{FIRST}={reference.dirs[FIRST]}",
                        name="smollm2-lora")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _expected_text(server, reference, adapter: str | None) -> str:
    ids = _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    tokens = reference.greedy(ids, adapter, NEW_TOKENS)
    return _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0).choices[0].text


def test_adapters_are_models_and_a_request_naming_one_gets_peft_text(lora_server, reference):
    client = lora_server.client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"smollm2", FIRST}
    assert models[FIRST].model_extra["parent"] == "smollm2" and models[FIRST].model_extra["root"] == reference.dirs[FIRST]
    assert client.models.retrieve(FIRST).id == FIRST
    adapted, base = _complete(client, FIRST), _complete(client, "smollm2")
    assert adapted == _expected_text(lora_server, reference, FIRST)
    assert base == _expected_text(lora_server, reference, None) and adapted != base
    with pytest.raises(openai.NotFoundError) as missing:
        _complete(client, "no-such-adapter")
    assert "The model `no-such-adapter` does not exist" in missing.value.message and FIRST in missing.value.message


def test_bad_adapter_calls_are_errors_naming_the_reason_and_the_server_goes_on(lora_server, reference, tmp_path):
    broken = tmp_path / "dora"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], '
                                                '"use_dora": true}')
    cases = [
        ("/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": str(broken)}, 400, "DoRA"),
        ("/v1/load_lora_adapter", {"lora_name": "nothing", "lora_path": str(tmp_path / "missing")}, 400, "nothing"),
        ("/v1/load_lora_adapter", {"lora_name": FIRST, "lora_path": reference.dirs[FIRST]}, 400,
         "has already been loaded"),
        ("/v1/load_lora_adapter", {"lora_name": "smollm2", "lora_path": reference.dirs[FIRST]}, 400, "base model"),
        ("/v1/load_lora_adapter", {"lora_name": "relative", "lora_path": "adapters/x"}, 400, "absolute"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "cannot be found"),
    ]
    for path, body, status, reason in cases:
        response = _post(lora_server, path, body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert reason.lower() in error["message"].lower() and error["code"] == status, (body, error)
    assert {m.id for m in lora_server.client().models.list().data} == {"smollm2", FIRST}
    assert _complete(lora_server.client(), FIRST) == _expected_text(lora_server, reference, FIRST)


def test_load_and_unload_while_requests_stream_change_no_request(lora_server, reference):
    client = lora_server.client()
    expected = {model: _expected_text(lora_server, reference, adapter)
                for model, adapter in (("smollm2", None), (FIRST, FIRST), (SECOND, SECOND))}
    results: dict[tuple[str, int], object] = {}
    stop = threading.Event()

    def traffic(model: str) -> None:
        for turn in range(40):  # bounded: the test stops it long before
            if stop.is_set():
                return
            try:
                results[(model, turn)] = _complete(client, model)
            except Exception as error:  # noqa: BLE001 - recorded and asserted below
                results[(model, turn)] = error

    threads = [threading.Thread(target=traffic, args=(model,)) for model in ("smollm2", FIRST)]
    for thread in threads:
        thread.start()
    try:
        loaded = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": SECOND, "lora_path": reference.dirs[SECOND]})
        assert loaded.status_code == 200 and loaded.text == f"Success: LoRA adapter '{SECOND}' added successfully."
        assert _complete(client, SECOND) == expected[SECOND]
        metrics = httpx.get(lora_server.url + "/metrics", timeout=30).text
        assert 'vllm:lora_requests_info{max_lora="2"' in metrics
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=300)
    assert len(results) >= 2
    for (model, _), text in results.items():
        assert text == expected[model], (model, text)
    unloaded = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": SECOND})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, SECOND)
    assert {m.id for m in client.models.list().data} == {"smollm2", FIRST}
    assert _complete(client, FIRST) == expected[FIRST]
