"""`lockstep up smollm2 --served-model-name my-model other-name` behind the gateway: /v1/messages with the official
`anthropic` client (create, stream, Anthropic-shaped errors, x-api-key), the ready banner and the default model
naming the first served name, and the unknown-model 404 listing what is served."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from gateway_harness import free_port, start_up, wait_for, wait_up

KEY = "sk-gateway-anthropic-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK's create() takes no temperature any more: an extra body field


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    directory = tmp_path_factory.mktemp("up-anthropic")
    (directory / "keys").write_text(KEY + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = directory / "up.log"
    up = start_up("smollm2", port, log_path, "--api-key-file", str(directory / "keys"), "--served-model-name",
                  "my-model", "other-name", "--max-model-len", "512")
    try:
        wait_up(up, url, log_path, engines=1, timeout=240)
        yield url, log_path
    finally:
        up.terminate()
        up.wait(60)


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack[0], api_key=KEY, max_retries=0, timeout=120.0)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_the_banner_and_a_request_without_model_take_the_first_served_name(stack):
    url, log_path = stack
    # up prints the banner at its next look at the engines, which may come after the gateway saw them ready
    banner = wait_for("the ready banner", lambda: [line for line in log_path.read_text().splitlines()
                                                   if "ready: OpenAI API at" in line], timeout=30)
    assert "(model 'my-model', 1 engine(s))" in banner[0]
    reply = _post(url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "my-model"


def test_an_unknown_model_404_lists_the_served_names(stack):
    reply = _post(stack[0], "/v1/chat/completions", {"model": "smollm2", "messages": QUESTION, "max_tokens": 4})
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "The model `smollm2` does not exist. Available: my-model, other-name."


def test_messages_create_and_stream_through_the_gateway(stack, client):
    chat = openai.OpenAI(base_url=stack[0] + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="other-name", messages=QUESTION, max_tokens=16, temperature=0)
    message = client.messages.create(model="other-name", max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    assert message.model == "other-name" and message.content[0].text == chat.choices[0].message.content
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(model="other-name", max_tokens=16, messages=QUESTION, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == message.content[0].text
    assert final.stop_reason == message.stop_reason


def test_gateway_errors_on_messages_are_anthropic_shaped(stack, client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-none", max_tokens=8, messages=QUESTION)
    error = missing.value.body["error"]
    assert error["type"] == "not_found_error" and "Available: my-model, other-name" in error["message"]
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic.Anthropic(base_url=stack[0], api_key="sk-wrong", max_retries=0).messages.create(
            model="my-model", max_tokens=8, messages=QUESTION)
    assert unauthorized.value.body["type"] == "error"
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    bad = _post(stack[0], "/v1/messages", {"model": "my-model", "messages": QUESTION})  # no max_tokens: the engine's
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_vllm_route_through_the_gateway_is_a_404_naming_it(stack):
    reply = _post(stack[0], "/sleep", {})
    assert reply.status_code == 404
    assert "does not serve /sleep (a vLLM route): there is no sleep mode" in reply.json()["error"]["message"]
    lora = _post(stack[0], "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/b"})
    assert lora.status_code == 404 and "the gateway does not load LoRA adapters" in lora.json()["error"]["message"]


def test_a_tokens_per_minute_limit_is_settled_by_anthropics_usage(stack, start_gateway):
    # Each request is estimated at ~310 tokens (max_tokens 300) of a 400/min budget, and answered in far
    # fewer: only when the usage (input + cache reads + output) gives the rest back does the second fit.
    engines = httpx.get(stack[0] + "/gateway/engines", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    engine = engines.json()["engines"][0]["url"]
    gateway = start_gateway(f"--engine={engine}", "--rate-limit-tpm=400", expect_healthy={engine})
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120.0)
    first = client.messages.create(model="my-model", max_tokens=300, messages=QUESTION, extra_body=GREEDY)
    assert first.stop_reason == "end_turn" and first.usage.output_tokens < 100
    with client.messages.stream(model="my-model", max_tokens=300, messages=QUESTION, extra_body=GREEDY) as stream:
        assert stream.get_final_message().content[0].text == first.content[0].text
    client.messages.create(model="my-model", max_tokens=300, messages=QUESTION, extra_body=GREEDY)
    assert gateway.metric("lockstep_gateway_rate_limited_requests_total") == 0
