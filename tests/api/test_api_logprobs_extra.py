"""vLLM's extras: text_offset in streams, continuous usage, /v1/models/{id}, /ping, refused parameters (N=8 and N=1)."""

import httpx
import openai
import pytest

PROMPT = "The capital of France is"


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_streamed_text_offsets_are_start_offsets_like_non_streamed(server_name, request):
    client = request.getfixturevalue(server_name).client()
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    offsets = whole.choices[0].logprobs.text_offset
    assert offsets[0] == 0
    assert offsets == [sum(map(len, whole.choices[0].logprobs.tokens[:i])) for i in range(len(offsets))]
    streamed = []
    for chunk in client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10, temperature=0,
                                           logprobs=1, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.text_offset
    assert streamed == offsets


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_continuous_usage_stats(server_name, request):
    client = request.getfixturevalue(server_name).client()
    chunks = [c for c in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
        if c.choices and c.choices[0].delta.content]
    assert chunks and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6


def test_model_by_id_and_ping(smol8):
    client = smol8.client()
    card = client.models.retrieve("smollm2")
    assert card.id == "smollm2" and card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("nope")
    assert error.value.body["param"] == "model"
    assert httpx.get(f"{smol8.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{smol8.url}/ping", timeout=10).status_code == 200


@pytest.mark.parametrize("body,param", [({"priority": 1}, "priority"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
                                        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids")])
def test_unhonoured_parameters_are_400s(smol8, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        smol8.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, extra_body=body)
    assert error.value.body["param"] == param
