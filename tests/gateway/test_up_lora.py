"""`lockstep up smollm2 --enable-lora --lora-modules ...`: the engine flags reach the engines, the gateway
learns their adapters, lists them in /v1/models and routes a request naming one to an engine serving it,
which answers with that adapter's text (transformers + peft's greedy tokens)."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import free_port, start_up, wait_up

pytest.importorskip("peft")

PROMPT = "Once upon a time, in a land far away,"
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory, peft_reference):
    directory = tmp_path_factory.mktemp("up-lora")
    reference = peft_reference
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = directory / "up.log"
    modules = [f"{name}={path}" for name, path in reference.dirs.items()]
    up = start_up("smollm2", port, log_path, "--max-model-len", "512", "--enable-lora", "--max-loras", "2",
                  "--lora-modules", *modules)
    try:
        wait_up(up, url, log_path, engines=1, timeout=240)
        yield url, reference
    finally:
        up.terminate()
        up.wait(60)


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                      "temperature": 0}, timeout=120)


def test_the_gateway_lists_the_adapters_and_routes_each_to_its_text(stack):
    url, reference = stack
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    assert set(models) == {"smollm2", *reference.dirs}
    assert all(models[name]["parent"] == "smollm2" and models[name]["root"] == path
               for name, path in reference.dirs.items())
    prompt_ids = httpx.post(url + "/tokenize", json={"model": "smollm2", "prompt": PROMPT}, timeout=30).json()["tokens"]
    texts = {}
    for name in [None, *reference.dirs]:
        response = _complete(url, name or "smollm2")
        assert response.status_code == 200, response.text
        texts[name] = response.json()["choices"][0]["text"]
        expected = reference.greedy(prompt_ids, name, NEW_TOKENS)
        detokenized = httpx.post(url + "/detokenize", json={"model": "smollm2", "tokens": expected}, timeout=30)
        assert texts[name] == detokenized.json()["prompt"], name
    assert all(texts[name] != texts[None] for name in reference.dirs)  # the adapters change the text
    missing = _complete(url, "no-such-adapter")
    assert missing.status_code == 404 and "no-such-adapter" in missing.json()["error"]["message"]
