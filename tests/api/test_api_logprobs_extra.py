"""vLLM's extras: text_offset in streams, continuous usage, /v1/models/{id}, /ping, prompt_logprobs, echo with
logprobs, return_tokens_as_token_ids, refused parameters (N=8 and N=1)."""

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


def test_unhonoured_priority_is_a_400(smol8):
    with pytest.raises(openai.BadRequestError) as error:
        smol8.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, extra_body={"priority": 1})
    assert error.value.body["param"] == "priority"


def _prompt_ids(server, text: str) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"model": "smollm2", "prompt": text}, timeout=30)
    return response.json()["tokens"]


def _check_prompt_logprobs(field, prompt_ids, k):
    """vLLM's shape: None, then per prompt token a map id -> {logprob, rank, decoded_token} holding the
    prompt's own token and the top k (ranks 1..k)."""
    assert len(field) == len(prompt_ids) and field[0] is None
    for position, entry in zip(prompt_ids[1:], field[1:]):
        own = entry[str(position)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert sorted(v["rank"] for v in entry.values() if v["rank"] <= k) == list(range(1, k + 1))
        assert len(entry) == k + (own["rank"] > k)


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_completions_echo_with_logprobs(server_name, request):
    server = request.getfixturevalue(server_name)
    client, ids = server.client(), _prompt_ids(server, PROMPT)
    kwargs = dict(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True,
                  extra_body={"ignore_eos": True})
    choice = client.completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 4
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    # The echoed logprobs are the prompt logprobs (vLLM: echo with logprobs asks for them).
    field = choice.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(field, ids, 2)
    assert lp.token_logprobs[1:len(ids)] == [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], field[1:])]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            for name, values in streamed.items():
                values += getattr(chunk.choices[0].logprobs, name)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}


def test_prompt_logprobs_chat_and_completions_at_n8_and_n1(smol8, smol1):
    messages = [{"role": "user", "content": "Name a colour."}]
    fields = []
    for server in (smol8, smol1):
        chat = server.client().chat.completions.create(model="smollm2", messages=messages, max_tokens=3,
                                                      temperature=0, extra_body={"prompt_logprobs": 2})
        fields.append(chat.model_extra["prompt_logprobs"])
        assert len(fields[-1]) == chat.usage.prompt_tokens
    assert fields[0] == fields[1]  # the window length does not change a prompt logprob
    completion = smol8.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, temperature=0,
                                                   extra_body={"prompt_logprobs": 0})
    _check_prompt_logprobs(completion.choices[0].model_extra["prompt_logprobs"], _prompt_ids(smol8, PROMPT), 0)
    plain = smol8.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("body,stream", [({"prompt_logprobs": 21}, False), ({"prompt_logprobs": -1}, False),
                                         ({"prompt_logprobs": 1}, True)])
def test_prompt_logprobs_out_of_range_are_400s(smol8, body, stream):
    with pytest.raises(openai.BadRequestError) as error:
        smol8.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, stream=stream, extra_body=body)
    assert error.value.body["param"] == "prompt_logprobs"
    assert str(body["prompt_logprobs"]) in error.value.body["message"]


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_return_tokens_as_token_ids(server_name, request):
    server = request.getfixturevalue(server_name)
    client = server.client()
    kwargs = dict(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs
    kwargs["extra_body"] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    as_ids = client.completions.create(**kwargs).choices[0]
    ids = [int(token.removeprefix("token_id:")) for token in as_ids.logprobs.tokens]
    assert all(token == f"token_id:{i}" for token, i in zip(as_ids.logprobs.tokens, ids))
    assert as_ids.text == "".join(plain.tokens)  # the text itself stays text
    decoded = [httpx.post(f"{server.url}/detokenize", json={"model": "smollm2", "tokens": [i]},
                          timeout=30).json()["prompt"] for i in ids]
    assert decoded == plain.tokens
    assert all(key.startswith("token_id:") for top in as_ids.logprobs.top_logprobs for key in top)
    assert as_ids.logprobs.token_logprobs == plain.token_logprobs
    streamed = []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens
    assert streamed == as_ids.logprobs.tokens
    chat_kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
                       logprobs=True, top_logprobs=1,
                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    chat = client.chat.completions.create(**chat_kwargs).choices[0].logprobs.content
    assert chat and all(e.token.startswith("token_id:") and e.bytes == list(e.token.encode()) for e in chat)
    assert all(top.token.startswith("token_id:") for e in chat for top in e.top_logprobs)
    chat_streamed = [e.token for chunk in client.chat.completions.create(stream=True, **chat_kwargs)
                     if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert chat_streamed == [e.token for e in chat]
