"""`lockstep serve --speculative-config` over HTTP with the official client: streamed chunks, logprobs, stop
strings and usage are those of the server without speculation; the spec_decode counters move; what
speculation cannot run is a 400 naming the field."""

import json

import openai
import pytest
from api_harness import Server

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
COPY = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "Repeat the code above exactly:\n\ndef add(a, b):\n")


@pytest.fixture(scope="module")
def spec_server():
    server = Server("smollm2", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
                    "--speculative-config", json.dumps(NGRAM), name="smol8-ngram")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def _stream(client, **body):
    text, logprobs, usage, chunks = "", [], None, 0
    for chunk in client.completions.create(model="smollm2", stream=True, stream_options={"include_usage": True},
                                           **body):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            chunks += 1
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs:
                logprobs += chunk.choices[0].logprobs.token_logprobs
    return text, logprobs, usage, chunks


def test_streamed_completion_is_the_plain_servers_token_for_token(spec_server, smol8):
    body = {"prompt": COPY, "max_tokens": 40, "temperature": 0, "logprobs": 1}
    drafts_before = spec_server.metric("vllm:spec_decode_num_draft_tokens_total")
    text, logprobs, usage, chunks = _stream(spec_server.client(), **body)
    plain_text, plain_logprobs, plain_usage, _ = _stream(smol8.client(), **body)
    assert text == plain_text and usage.completion_tokens == plain_usage.completion_tokens == 40
    assert usage.prompt_tokens == plain_usage.prompt_tokens
    assert logprobs == pytest.approx(plain_logprobs, abs=1e-3)
    assert chunks > 1  # streamed (a chunk may carry several tokens, as vLLM's do with speculation)
    accepted = spec_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert spec_server.metric("vllm:spec_decode_num_draft_tokens_total") > drafts_before and accepted > 0
    first, second = (spec_server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                     for j in (0, 1))
    assert first >= second and first > 0
    assert spec_server.metric("lockstep_spec_decode_accepted_tokens_total") == accepted


def test_stop_strings_and_max_tokens_cut_accepted_tokens_exactly(spec_server, smol8):
    for body in ({"prompt": COPY, "max_tokens": 40, "temperature": 0, "stop": ["sub"]},
                 {"prompt": COPY, "max_tokens": 7, "temperature": 0}):
        got = spec_server.client().completions.create(model="smollm2", **body)
        plain = smol8.client().completions.create(model="smollm2", **body)
        assert got.choices[0].text == plain.choices[0].text
        assert got.choices[0].finish_reason == plain.choices[0].finish_reason
        assert got.usage.completion_tokens == plain.usage.completion_tokens


def test_what_speculation_cannot_run_is_a_400_naming_the_field(spec_server):
    client = spec_server.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=4, presence_penalty=0.5)
    assert "presence_penalty" in str(error.value) and "speculative decoding" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format={"type": "json_object"})
    assert "response_format" in str(error.value)
