"""`--reasoning-parser`: the <think> text apart from the answer, in chat (whole and streamed), the Responses API
(reasoning items, streamed as reasoning_text events) and /v1/messages (thinking blocks).

SmolLM2 writes no think tags of its own: structured outputs make it (a regex that opens and closes the tag),
and where a route cannot take a constraint, an answer without `</think>` is all reasoning under deepseek_r1
(its chat template writes `<think>` into the prompt, so the output is reasoning until it closes the tag)."""

import anthropic
import httpx
import pytest
from api_harness import Server

from lockstep_engine.api.reasoning import ReasoningStream, split

THINKING = {"structured_outputs": {"regex": "<think>[a-z ]{3,40}</think>[A-Za-z0-9 ]{3,40}[.]"}}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


# ---- the parsers --------------------------------------------------------------------------------
def test_deepseek_r1_splits_at_the_end_tag_and_an_unclosed_answer_is_reasoning():
    assert split("deepseek_r1", "<think>add them</think>It is 4.") == ("add them", "It is 4.")
    assert split("deepseek_r1", "add them</think>It is 4.") == ("add them", "It is 4.")  # <think> was in the prompt
    assert split("deepseek_r1", "still thinking") == ("still thinking", None)
    assert split("deepseek_r1", "<think>done</think>") == ("done", None)


def test_qwen3_reasons_only_inside_the_tags():
    assert split("qwen3", "<think>add them</think>It is 4.") == ("add them", "It is 4.")
    assert split("qwen3", "It is 4.") == (None, "It is 4.")  # thinking off
    assert split("qwen3", "add them</think>It is 4.") == ("add them", "It is 4.")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_stream_split_token_by_token_never_sends_a_tag_and_adds_up(parser):
    text = "<think>add two and two</think>It is 4."
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for end in range(1, len(text) + 1):
        new_reasoning, new_content = stream.feed(0, text[:end], end == len(text))
        reasoning, content = reasoning + new_reasoning, content + new_content
        assert "<" not in reasoning and "<" not in content
    assert (reasoning, content) == ("add two and two", "It is 4.")


def test_qwen3_streams_an_answer_without_tags_as_content():
    stream = ReasoningStream("qwen3")
    assert stream.feed(0, "<th", False) == ("", "")  # could still open a tag
    assert stream.feed(0, "<thx and more", False) == ("", "<thx and more")


# ---- through a server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    server = Server("smollm2", "--reasoning-parser", "deepseek_r1", "--max-model-len", "512",
                    "--kv-cache-memory-bytes", str(64 << 20), name="reasoning")
    yield server.wait_healthy()
    server.stop()


def _raw_text(server, messages, max_tokens: int, **extra) -> str:
    """What the model wrote for this conversation, tags included (the completions route parses nothing)."""
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    return server.client().completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              extra_body=extra).choices[0].text


def test_chat_returns_the_reasoning_apart_from_the_content(server):
    reply = server.client().chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=48,
                                                    temperature=0, extra_body=THINKING)
    message = reply.choices[0].message
    raw = _raw_text(server, QUESTION, 48, **THINKING)
    assert raw == f"<think>{message.reasoning_content}</think>{message.content}"
    assert message.reasoning_content and message.content
    assert message.model_extra["reasoning"] == message.reasoning_content  # vLLM's newer name for it


def test_streamed_chat_sends_reasoning_deltas_then_content_deltas(server):
    client = server.client()
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=48, temperature=0,
                                           extra_body=THINKING).choices[0].message
    reasoning, content, order = "", "", []
    for chunk in client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=48, temperature=0,
                                                extra_body=THINKING, stream=True):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning += extra["reasoning_content"]
            order.append("reasoning")
        if delta.content:
            content += delta.content
            order.append("content")
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    assert order == sorted(order, key=lambda kind: kind == "content") and len(set(order)) == 2


def test_responses_give_a_reasoning_item_before_the_message(server):
    client = server.client()
    question = "What is 2+2?"
    raw = _raw_text(server, [{"role": "user", "content": question}], 16)
    assert "</think>" not in raw  # so under deepseek_r1 all of it is reasoning
    response = client.responses.create(model="smollm2", input=question, max_output_tokens=16, temperature=0)
    thinking, message = response.output
    assert thinking.type == "reasoning" and thinking.content[0].type == "reasoning_text"
    assert thinking.content[0].text == raw and thinking.summary == []
    assert message.type == "message" and message.content[0].text == ""
    with client.responses.stream(model="smollm2", input=question, max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert deltas == raw
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == raw


def test_messages_give_a_thinking_block_first(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120.0)
    raw = _raw_text(server, QUESTION, 48, **THINKING)
    message = client.messages.create(model="smollm2", max_tokens=48, messages=QUESTION,
                                     extra_body={"temperature": 0, **THINKING})
    thinking, text = message.content
    assert (thinking.type, text.type) == ("thinking", "text")
    assert raw == f"<think>{thinking.thinking}</think>{text.text}"
    with client.messages.stream(model="smollm2", max_tokens=48, messages=QUESTION,
                                extra_body={"temperature": 0, **THINKING}) as stream:
        final = stream.get_final_message()
    assert [(block.type, getattr(block, "thinking", None) or getattr(block, "text", None))
            for block in final.content] == [("thinking", thinking.thinking), ("text", text.text)]
