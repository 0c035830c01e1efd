"""`/v1/messages` (Anthropic's Messages API) on `lockstep serve`, with the official `anthropic` client: create,
stream, stop reasons, tools, usage, count_tokens and Anthropic-shaped errors; plus what this server's
other routes say to a vLLM user (the 404s of vLLM routes, continuous usage from the first chunk, the
ignored --gpu-memory-utilization on the CPU)."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from api_harness import Server

from lockstep_engine.api.anthropic import MessagesRequest, chat_request

KEY = "anthropic-test-key"
NAME = "smol-messages"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
# The SDK's create() no longer takes temperature, top_p or top_k (newer Claude models fix them): they go as
# extra body fields, which this server reads as the Messages API defines them.
GREEDY = {"temperature": 0}


def test_a_conversation_becomes_the_chat_request_it_means():
    chat = chat_request(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}], "temperature": 0.5,
        "top_p": 0.9, "top_k": 7, "stop_sequences": ["END"], "metadata": {"user_id": "u1"}, "seed": 3,
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris", "unit": "c"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "18 C"}]},
                                         {"type": "text", "text": "And?"}]}]}))
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop, chat.user, chat.seed) == \
        (9, 0.5, 0.9, 7, ["END"], "u1", 3)
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                            "description": "Weather in a city"}}]
    roles = [(m.role, m.model_extra.get("tool_call_id")) for m in chat.messages]
    assert roles == [("system", None), ("user", None), ("assistant", None), ("tool", "toolu_1"), ("user", None)]
    assert [part.text for part in chat.messages[2].content] == ["Checking."]
    [call] = chat.messages[2].model_extra["tool_calls"]
    assert call == {"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    assert chat.messages[3].content == "18 C"
    named = chat_request(MessagesRequest.model_validate({"max_tokens": 1, "messages": QUESTION, "tools": TOOLS,
                                                         "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    server = Server("smollm2", "--served-model-name", NAME, "--max-model-len", "512", "--kv-cache-memory-bytes",
                    str(64 << 20), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--gpu-memory-utilization", "0.5", name="anthropic", api_key=KEY)
    yield server.wait_healthy()
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120.0)


def _chat(server, max_tokens: int, **extra) -> openai.types.chat.ChatCompletion:
    return server.client().chat.completions.create(
        model=NAME, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, *QUESTION], **extra)


def test_create_answers_as_the_chat_endpoint_does(server, client):
    message = client.messages.create(model=NAME, max_tokens=24, extra_body=GREEDY, system=SYSTEM, messages=QUESTION)
    chat = _chat(server, 24)
    assert message.type == "message" and message.role == "assistant" and message.model == NAME
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert "Paris" in block.text
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_stream_sends_anthropics_event_sequence_with_the_same_text(client):
    request = dict(model=NAME, max_tokens=24, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM}],
                   messages=QUESTION)
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = [event.type for event in stream if event.type != "text"]  # "text": the SDK's own helper events
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    body = [kind for kind in events[1:-2] if kind != "ping"]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"} and len(body) >= 3
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_stop_sequences_and_max_tokens_set_the_stop_reason(client):
    request = dict(model=NAME, extra_body=GREEDY, system=SYSTEM, messages=QUESTION)
    text = client.messages.create(max_tokens=24, **request).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(max_tokens=24, stop_sequences=[word], **request)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert stopped.content[0].text == text[:text.index(word)]
    short = client.messages.create(max_tokens=3, **request)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_raw_stream_events_are_anthropic_sse(server):
    response = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                          json={"model": NAME, "max_tokens": 4, "stream": True, "messages": QUESTION}, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = [frame.split("\n") for frame in response.text.strip().split("\n\n")]
    for lines in frames:
        kind = lines[0].removeprefix("event: ")
        assert json.loads(lines[1].removeprefix("data: "))["type"] == kind
    start = json.loads(frames[0][1][6:])["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = json.loads(frames[-2][1][6:])
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4


def test_a_forced_tool_gives_a_tool_use_block_and_the_result_goes_back(client):
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(model=NAME, max_tokens=64, extra_body=GREEDY, messages=weather, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    assert message.stop_reason == "tool_use"
    history = weather + [{"role": "assistant", "content": message.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                       "content": "18 degrees and sunny"},
                                                      {"type": "text", "text": "Say it in a sentence."}]}]
    answer = client.messages.create(model=NAME, max_tokens=24, extra_body=GREEDY, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.content[0].text


def test_any_tool_streams_a_tool_use_block_with_the_same_input(client):
    request = dict(model=NAME, max_tokens=64, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "any"},
                   messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    [call] = [block for block in final.content if block.type == "tool_use"]
    [expected] = [block for block in whole.content if block.type == "tool_use"]
    assert (call.name, call.input) == (expected.name, expected.input) and final.stop_reason == "tool_use"


def test_count_tokens_is_the_prompt_the_answer_counts(client):
    counted = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=QUESTION)
    usage = client.messages.create(model=NAME, max_tokens=1, system=SYSTEM, messages=QUESTION).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_errors_are_anthropic_shaped(server, client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-none", max_tokens=8, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert f"Available: {NAME}" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=8, messages=QUESTION)
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    post = lambda body: httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=60)
    assert "max_tokens" in _anthropic_error(post({"model": NAME, "messages": QUESTION}), 400, "invalid_request_error")
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]
    message = _anthropic_error(post({"model": NAME, "max_tokens": 8, "messages": image}), 400, "invalid_request_error")
    assert message.startswith("messages.0.content.0: content blocks of type 'image' are not supported")
    assert "request_id" in post({"model": NAME, "messages": []}).json()
    _anthropic_error(post({"model": NAME, "max_tokens": 8, "messages": QUESTION, "tools": TOOLS,
                           "tool_choice": {"type": "tool", "name": "nope"}}), 400, "invalid_request_error")


def test_vllm_routes_this_server_lacks_are_openai_404s_naming_them(server):
    for method, path in (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/sleep"),
                         ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/invocations"), ("POST", "/v2/embed"),
                         ("POST", "/pooling"), ("POST", "/classify"), ("POST", "/score"), ("POST", "/v1/rerank"),
                         ("POST", "/v1/audio/transcriptions"), ("GET", "/load")):
        response = httpx.request(method, server.url + path, headers=server.headers(), json={}, timeout=10)
        assert response.status_code == 404, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "NotFoundError" and error["code"] == 404
        assert f"this server does not serve {path} (a vLLM route)" in error["message"], error["message"]
    lora = httpx.post(server.url + "/v1/load_lora_adapter", headers=server.headers(), json={}, timeout=10)
    assert "only by an engine started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true" in \
        lora.json()["error"]["message"]


def test_the_first_streamed_chunk_carries_continuous_usage(server):
    stream = server.client().chat.completions.create(
        model=NAME, max_tokens=4, messages=QUESTION, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert first.usage is not None and first.usage.completion_tokens == 0 and first.usage.prompt_tokens > 0
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[-1].usage.completion_tokens == 4


def test_gpu_memory_utilization_on_the_cpu_is_reported_as_ignored(server):
    assert "warning: --gpu-memory-utilization 0.5 is ignored on the CPU" in server.log_tail(200)


def test_a_short_answer_leaves_its_prompt_in_the_prefix_cache(client):
    # A prompt of ~150 tokens answered in the window that computed it (max_tokens <= N=8): its full blocks
    # are cached, so the same request again reads all of them (the last prompt token is always computed).
    system = "You answer questions about cities. " * 20
    for max_tokens in (1, 8):
        question = [{"role": "user", "content": f"Name a city ({max_tokens})."}]
        first = client.messages.create(model=NAME, max_tokens=max_tokens, system=system, messages=question)
        prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
        assert prompt > 130
        again = client.messages.create(model=NAME, max_tokens=max_tokens, system=system, messages=question)
        assert again.usage.cache_read_input_tokens == (prompt - 1) // 16 * 16, max_tokens
