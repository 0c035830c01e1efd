"""Structured outputs as vLLM takes them (`guided_*`, `structured_outputs`) through real servers at N=8 and N=1.

Each output is checked against its constraint: a choice is one of the list, a regex matches in
full, JSON validates against the schema, a grammar's language holds.
"""

import json
import os
import re
import subprocess
import sys
import time

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
    ({"guided_choice": [f"c{i}" for i in range(100_001)]}, "guided_choice", "at most 100000 are allowed"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex", "multiply to 1000000; at most 10000"),
    ({"structured_outputs": {"grammar": "start: /(x{200}){200}/"}}, "structured_outputs.grammar", "multiply to 40000"),
])
def test_bad_constraints_are_400s_naming_the_field(smol8, body, param, words):
    response = httpx.post(f"{smol8.url}/v1/completions", timeout=30,
                          json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_choice_list_past_2000_answers_one_of_its_choices(smol1):
    # llguidance's parser takes 2000 alternatives in one grammar row: past that the text was none of them.
    choices = [f"item {i}" for i in range(2500)]
    response = smol1.client().completions.create(model="smollm2", prompt="Pick an item:", max_tokens=10,
                                                 temperature=1.0, seed=5, extra_body={"guided_choice": choices})
    assert response.choices[0].text in choices, response.choices[0]
    assert response.choices[0].finish_reason == "stop"


def test_a_choice_with_a_control_character_is_answered(smol1):
    # JSON leaves DEL raw, and llguidance's Lark lexer refused it: a 400 "lexer error" for a valid list.
    choices = ["a\x7fb", "plain"]
    response = smol1.client().completions.create(model="smollm2", prompt="Pick:", max_tokens=5, temperature=0,
                                                 extra_body={"guided_choice": choices})
    assert response.choices[0].text in choices


# Sends one request body, read from a file, when told to on stdin: a process of its own, so that
# encoding and sending 2.3 MB holds no GIL of the process that times the stream's chunks.
SENDER = r"""
import sys, httpx
url, path = sys.argv[1], sys.argv[2]
with open(path, "rb") as handle:
    body = handle.read()
print("ready", flush=True)
sys.stdin.readline()
response = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=120)
print(response.status_code, flush=True)
print(response.text, flush=True)
"""


def test_100000_choices_compile_beside_a_stream_that_keeps_its_cadence(smol1, tmp_path):
    """The list compiles in the core's grammar thread (the API checks only its shape and size): neither
    event loop nor the engine loop waits for it, so a running stream's largest gap between two chunks
    stays small. N=1, a chunk per token (at N=8 a window of SmolLM2 steps on the CPU takes 0.6-0.8 s by
    itself). The gap measures the machine too: with other jobs loading both cores it grew to 1.6-2.7 s
    (docs/RELIABILITY.md)."""
    choices = [f"option number {i}" for i in range(100_000)]
    body = tmp_path / "guided.json"
    body.write_text(json.dumps({"model": "smollm2", "prompt": "Pick one:", "max_tokens": 20,
                                "guided_choice": choices}))
    sender = subprocess.Popen([sys.executable, "-c", SENDER, f"{smol1.url}/v1/completions", str(body)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert sender.stdout.readline().strip() == "ready"
    arrivals: list[float] = []
    span = []
    with httpx.stream("POST", f"{smol1.url}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True,
            "stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 5:
                span.append(time.monotonic())
                sender.stdin.write("go\n")
                sender.stdin.flush()
            if len(span) == 1 and sender.poll() is not None:
                span.append(time.monotonic())
                break  # the guided request is answered: the stream kept going all along
    status, _, text = sender.communicate(timeout=120)[0].partition("\n")
    assert status == "200", (sender.returncode, text)
    assert json.loads(text)["choices"][0]["text"] in choices
    start, end = span[0], span[-1] if len(span) == 2 else time.monotonic()
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]) if b >= start and a <= end)
    assert gaps, arrivals
    figures = f"largest gap {gaps[-1]:.3f} s, median {gaps[len(gaps) // 2]:.3f} s while the 100,000 choices compiled"
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if gaps[-1] >= 0.5 and load > 2 * cores:
        # The test itself keeps two or three threads busy; past twice the cores, other jobs share them, and
        # a stream's gaps grow as much with no grammar at all (docs/RELIABILITY.md).
        pytest.xfail(f"{figures}, at load average {load:.1f} on {cores} cores")
    assert gaps[-1] < 0.5, f"{figures} (load average {load:.1f} on {cores} cores)"
