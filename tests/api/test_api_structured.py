"""Structured outputs as vLLM takes them (`guided_*`, `structured_outputs`) through real servers at N=8 and N=1.

Each output is checked against its constraint: a choice is one of the list, a regex matches in
full, JSON validates against the schema, a grammar's language holds.
"""

import json
import re

import httpx
import jsonschema
import pytest

PROMPT = "Is the sky blue? Answer:"
MESSAGES = [{"role": "user", "content": "Give me a city and a number."}]
CHOICES = ["yes", "no", "maybe not"]
PHONE = r"\d{3}-\d{4}"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
LARK = 'start: "A" DIGIT DIGIT\nDIGIT: /[0-9]/'
GBNF = 'root ::= "B" [0-9] [0-9]'


def _extra(case: str, newer: bool) -> dict:
    kind, value = {"choice": ("choice", CHOICES), "regex": ("regex", PHONE), "json": ("json", SCHEMA),
                   "lark": ("grammar", LARK), "gbnf": ("grammar", GBNF)}[case]
    return {"structured_outputs": {kind: value}} if newer else {f"guided_{kind}": value}


def _check(case: str, text: str) -> None:
    if case == "choice":
        assert text in CHOICES
    elif case == "regex":
        assert re.fullmatch(PHONE, text), text
    elif case == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif case == "lark":
        assert re.fullmatch(r"A\d\d", text), text
    else:
        assert re.fullmatch(r"B\d\d", text), text


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
@pytest.mark.parametrize("case,newer", [("choice", False), ("regex", True), ("json", False), ("json", True),
                                        ("lark", False), ("gbnf", True)])
def test_completion_output_meets_the_constraint(server_name, case, newer, request):
    client = request.getfixturevalue(server_name).client()
    response = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=40, temperature=0.8, seed=3,
                                         n=2, extra_body=_extra(case, newer))
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        _check(case, choice.text)


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_streamed_chat_choice_and_regex(server_name, request):
    client = request.getfixturevalue(server_name).client()
    for case in ("choice", "regex"):
        chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=20,
                                                     temperature=0.5, seed=1, stream=True,
                                                     extra_body=_extra(case, case == "regex")))
        _check(case, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_guided_json_as_a_string_and_response_format_together_is_refused(smol8):
    client = smol8.client()
    response = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=40, temperature=0,
                                              extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    both = httpx.post(f"{smol8.url}/v1/chat/completions", timeout=30, json={
        "model": "smollm2", "messages": MESSAGES, "guided_regex": PHONE, "response_format": {"type": "json_object"}})
    assert both.status_code == 400
    assert "only one structured-output constraint" in both.json()["error"]["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "[0-9"}, "guided_regex", "unclosed character class"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "unknown name"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_decoding_backend": "xgrammar", "guided_choice": ["a"]}, "guided_decoding_backend", "llguidance"),
    ({"guided_whitespace_pattern": r"\s*", "guided_json": {}}, "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs.regex", "only one"),
])
def test_bad_constraints_are_400s_naming_the_field(smol8, body, param, words):
    response = httpx.post(f"{smol8.url}/v1/completions", timeout=30,
                          json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
