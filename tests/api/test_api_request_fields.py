"""Every request field is honoured or refused with a 400 naming it, never accepted without effect:
vLLM's allowed_token_ids, bad_words, truncate_prompt_tokens and parallel_tool_calls work at N=8 and
N=1 with the same greedy text; use_beam_search and other servers' spellings are refused; docs/API.md
lists every field the request models declare, with its status."""

from __future__ import annotations

import json
import os
import re

import httpx
import openai
import pytest

from api_harness import REPO

PROMPT = "The capital of France is"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city", "unit"]}}}


@pytest.fixture(params=["smol8", "smol1"])
def client(request) -> openai.OpenAI:
    server = request.getfixturevalue(request.param)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(client: openai.OpenAI, prompt=PROMPT, **extra):
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body=extra)


def token_ids(choice) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]


def test_allowed_token_ids_are_the_only_tokens_sampled(client):
    only = complete(client, allowed_token_ids=[504], ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    assert token_ids(only.choices[0]) == [504] * 6
    few = complete(client, allowed_token_ids=[504, 1214, 3575], ignore_eos=True, logprobs=0,
                   return_tokens_as_token_ids=True, temperature=1.0, seed=1)
    assert set(token_ids(few.choices[0])) <= {504, 1214, 3575}


def test_bad_words_are_never_generated_and_the_text_is_the_same_at_every_step_count(smol8, smol1):
    texts = []
    for server in (smol8, smol1):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert "Paris" in complete(client).choices[0].text
        texts.append(complete(client, bad_words=["Paris"]).choices[0].text)
    assert texts[0] == texts[1] and "Paris" not in texts[0] and texts[0].strip(), texts


STORY = "Once upon a time"  # greedy: ", the city of Nova Haven was a thriving metropolis, with towering ..."


def test_a_bad_word_of_several_tokens_never_appears_while_its_prefix_may(smol8, smol1):
    """vLLM's rule: the last token of a word is banned right after its other tokens. At N=8 "the city of
    Nova" would lie inside the first window; "a thriving" would be its last token and the next window's
    first."""
    texts = []
    for server in (smol8, smol1):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        free = complete(client, prompt=STORY, max_tokens=40).choices[0].text
        assert "the city of Nova" in free and "a thriving" in free, free
        texts.append(complete(client, prompt=STORY, max_tokens=40,
                              bad_words=["the city of Nova", " a thriving"]).choices[0].text)
    assert texts[0] == texts[1], texts
    banned = texts[0]
    assert "city of Nova" not in banned and "a thriving" not in banned, banned
    assert banned.startswith(", the city of ") and " a " in banned, banned  # the prefixes themselves may appear


def test_bad_words_the_server_cannot_hold_are_refused_by_name(client):
    for words, words_in_message in ((["", "Paris"], "has no tokens"), (["word"] * 129, "at most 128"),
                                    (["x" * 1025], "at most 1024 characters"),
                                    ([" ".join(["and"] * 40)], "at most 32 are allowed")):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(client, bad_words=words)
        assert refused.value.body["param"] == "bad_words" and words_in_message in refused.value.message, words


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(client):
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    ids = httpx.post(root + "/tokenize", json={"model": "smollm2", "prompt": PROMPT}, timeout=30).json()["tokens"]
    cut = complete(client, truncate_prompt_tokens=3)
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == complete(client, prompt=ids[-3:]).choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, truncate_prompt_tokens=0)
    assert refused.value.body["param"] == "truncate_prompt_tokens"


def test_parallel_tool_calls_false_gives_one_call_at_most(client):
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Paris and in Rome, in celsius?"}],
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"


def test_a_required_tool_call_cut_by_max_tokens_is_still_a_tool_call(client):
    request = dict(model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tools=[WEATHER], tool_choice="required", max_tokens=10, temperature=0)
    answer = client.chat.completions.create(**request)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    streamed = [chunk.choices[0] for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices]
    deltas = [call for c in streamed for call in c.delta.tool_calls or ()]
    assert [call.function.name for call in deltas] == ["get_weather"] and streamed[-1].finish_reason == "length"
    assert deltas[0].function.arguments == choice.message.tool_calls[0].function.arguments


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", True), ("regex", "[0-9]+"), ("ebnf", 'root ::= "yes"'), ("json_schema", {"type": "object"}),
    ("length_penalty", 0.5), ("logits_processors", ["my.module:Processor"]), ("vllm_xargs", {"k": 1}),
    ("kv_transfer_params", {"do_remote_prefill": True}), ("cache_salt", "tenant-a"), ("return_token_ids", True)])
def test_fields_this_server_cannot_honour_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, **{field: value})
    assert refused.value.body["param"] == field and field in refused.value.message


def test_vllm_extras_at_their_defaults_are_accepted(client):
    answer = complete(client, length_penalty=1.0, logits_processors=[], vllm_xargs={}, kv_transfer_params=None,
                      cache_salt=None, return_token_ids=False)
    assert answer.choices[0].text == complete(client).choices[0].text


def test_a_client_request_id_names_the_response_and_requests_sharing_it_stay_apart(client):
    first = complete(client, request_id="trace-42")
    second = complete(client, prompt="The capital of Italy is", request_id="trace-42")
    assert first.id == second.id == "cmpl-trace-42"
    assert first.choices[0].text != second.choices[0].text  # two requests, not one answer twice
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"request_id": "trace-43"})
    assert chat.id == "chatcmpl-trace-43"
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, request_id="x" * 257)
    assert refused.value.body["param"] == "request_id"


def test_documents_and_reasoning_effort_are_checked_and_reach_the_chat_template(client):
    from lockstep_engine.api import tools
    from lockstep_engine.api.openai_models import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}],
                                                 "documents": [{"title": "a", "text": "b"}],
                                                 "reasoning_effort": "low"})
    assert tools.template_kwargs(body) == {"documents": [{"title": "a", "text": "b"}], "reasoning_effort": "low"}
    chat = dict(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    client.chat.completions.create(**chat, extra_body={"documents": [{"title": "a", "text": "b"}],
                                                       "reasoning_effort": "low"})
    for field, value in (("documents", [{"title": 5}]), ("documents", "text"), ("reasoning_effort", "max")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**chat, extra_body={field: value})
        assert field in refused.value.message


def test_docs_list_every_request_field_with_its_status():
    from lockstep_engine.api import extras
    from lockstep_engine.api.openai_models import ChatCompletionRequest, CompletionRequest

    with open(os.path.join(REPO, "docs", "API.md"), encoding="utf-8") as handle:
        text = handle.read()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (honoured|refused)\b", section, re.MULTILINE))
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert declared | set(extras.FOREIGN_FIELDS) == set(rows), "a request field without a row in docs/API.md"
    # An honoured field is read by the code that serves requests, not only declared.
    sources = ""
    for name in os.listdir(os.path.join(REPO, "engine", "lockstep_engine", "api")):
        if name.endswith(".py") and name != "openai_models.py":
            with open(os.path.join(REPO, "engine", "lockstep_engine", "api", name), encoding="utf-8") as handle:
                sources += handle.read()
    unread = [f for f, status in rows.items() if status == "honoured" and not re.search(rf"\.{f}\b|\"{f}\"", sources)]
    assert not unread, f"declared as honoured but never read: {unread}"


def test_a_tool_s_parameters_schema_is_closed(client):
    """All properties listed and required, no additionalProperties: no invented third key (vLLM's default
    backend and OpenAI's strict tools agree)."""
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city", "unit"}


def test_a_strict_json_schema_is_closed(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert answer.choices[0].finish_reason == "stop"
    assert set(json.loads(answer.choices[0].message.content)) == {"name", "age"}
