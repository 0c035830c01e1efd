"""/v1/chat/completions and guided JSON through real servers (SmolLM2 at N=8 and N=1)."""

import json

import httpx
import jsonschema
import pytest

from lockstep_engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_greedy_chat_equals_the_offline_api(smol8, offline_smollm2):
    expected = offline_smollm2.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=24))[0]
    response = smol8.client().chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24,
                                                      temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(smol8):
    client = smol8.client()
    whole = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]


def test_chat_max_completion_tokens_n_2_and_seeds(smol8):
    client = smol8.client()

    def sample():
        return client.chat.completions.create(model="smollm2", messages=MESSAGES, n=2, temperature=1.0, seed=5,
                                              max_completion_tokens=6, extra_body={"ignore_eos": True})

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 12
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]


def test_chat_logprobs_with_top_logprobs(smol8):
    response = smol8.client().chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=5,
                                                      temperature=0, logprobs=True, top_logprobs=2,
                                                      extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


@pytest.mark.parametrize("server_name", ["smol1", "smol8"])
def test_json_schema_responses_validate(server_name, request):
    server = request.getfixturevalue(server_name)
    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature in (0.0, 1.0):
        response = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Describe a person as JSON."}],
            max_tokens=60, temperature=temperature, seed=1, response_format=response_format)
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A person, please."}], max_tokens=60,
        temperature=0.7, seed=2, response_format=response_format, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)


def test_json_object_response_format(smol8):
    response = smol8.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Reply with a JSON object with the keys name and age "
                                                               "of a famous person."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_a_top_level_chat_template_is_rendered_when_trusted(servers):
    """vLLM's `chat_template` request field: with --trust-request-chat-template it is the template used
    (the prompt's token count is that of its rendering), and `chat_template_kwargs` wins over it."""
    server = servers("smoltools")
    template = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"
    response = server.client().chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=2, temperature=0,
        extra_body={"chat_template": template, "add_generation_prompt": False})

    def count(text: str) -> int:
        return httpx.post(f"{server.url}/tokenize", timeout=30,
                          json={"prompt": text, "add_special_tokens": False}).json()["count"]

    assert response.usage.prompt_tokens == count("<<user|What is 2+2?>>")
    overridden = server.client().chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=2, temperature=0,
        extra_body={"chat_template": template, "chat_template_kwargs": {"chat_template": "[{{ messages[0].content }}]"},
                    "add_generation_prompt": False})
    assert overridden.usage.prompt_tokens == count("[What is 2+2?]")
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                         json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 2, "chat_template": 5})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "chat_template"
