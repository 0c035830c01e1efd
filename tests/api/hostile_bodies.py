"""Request bodies the schema fuzzers cannot write, for both fuzz suites (the engine's and the gateway's):
raw invalid UTF-8 (bytes no JSON encoder emits: a surrogate encoded as UTF-8, ED A0 80, and a stray
0xFF) in each text field and in a key, and tool fields of the wrong type. Every one must get an
OpenAI-shaped 400, never a 5xx; `send_all` returns what came back."""

from __future__ import annotations

import json

import httpx

SURROGATE = b"\xed\xa0\x80"  # U+D800 encoded as UTF-8: invalid UTF-8 that json.loads lets through
STRAY = b"\xff"
MARK = b"@@"  # where the raw bytes go in a body template


def _body(fields: dict, raw: bytes) -> bytes:
    return json.dumps(fields).encode().replace(MARK, raw)


def cases(model: str) -> list[tuple[str, str, bytes, str | None]]:
    """(name, path, body, the param the engine's 400 names or None where it names another)."""
    text_fields = [
        ("model", "/v1/completions", {"model": "m@@", "prompt": [1], "max_tokens": 1}, "model"),
        ("prompt", "/v1/completions", {"model": model, "prompt": "hi @@", "max_tokens": 1}, "prompt"),
        ("prompt list", "/v1/completions", {"model": model, "prompt": ["ok", "@@"], "max_tokens": 1}, "prompt.1"),
        ("user", "/v1/completions", {"model": model, "prompt": [1], "max_tokens": 1, "user": "u@@"}, "user"),
        ("stop", "/v1/completions", {"model": model, "prompt": [1], "max_tokens": 1, "stop": ["@@"]}, "stop.0"),
        ("chat content", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": "@@"}], "max_tokens": 1}, "messages.0.content"),
        ("key", "/v1/completions", {"model": model, "prompt": [1], "max_tokens": 1, "x@@": 1}, "body"),
        ("tokenize", "/tokenize", {"model": model, "prompt": "@@"}, "prompt"),
    ]
    found = []
    for name, path, fields, param in text_fields:
        found.append((f"{name}: surrogate bytes", path, _body(fields, SURROGATE), param))
        found.append((f"{name}: stray byte", path, _body(fields, STRAY), param))
    found.append(("escaped lone surrogate in a key", "/v1/completions",
                  b'{"model": "' + model.encode() + b'", "prompt": [1], "\\udc00": 1}', "body"))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    wrong_tools = [
        ("tool_choice function as a string", {**chat, "tools": [tool], "tool_choice": {"type": "function",
                                                                                     "function": "f"}}, "tool_choice"),
        ("tool_choice function without a name", {**chat, "tools": [tool], "tool_choice": {"type": "function",
                                                                                         "function": {}}},
         "tool_choice"),
        ("tool_choice a number", {**chat, "tools": [tool], "tool_choice": 5}, None),
        ("tools a string", {**chat, "tools": "zz"}, None),
        ("a tool a number", {**chat, "tools": [5]}, None),
        ("history tool_calls function a number", {**chat, "messages": [
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": 5}]},
            {"role": "user", "content": "go on"}]}, None),
        ("history tool_calls a string", {**chat, "messages": [
            {"role": "assistant", "content": "", "tool_calls": "zz"}, {"role": "user", "content": "go on"}]}, None),
        ("history tool_call_id a list", {**chat, "messages": [
            {"role": "tool", "content": "1", "tool_call_id": [1]}, {"role": "user", "content": "go on"}]}, None),
    ]
    found += [(name, "/v1/chat/completions", json.dumps(fields).encode(), param) for name, fields, param in wrong_tools]
    return found


def send_all(base_url: str, model: str, headers: dict | None = None) -> list[tuple[str, int, dict, str | None]]:
    """(case name, status, the error object, expected param) for every case."""
    answers = []
    with httpx.Client(timeout=30) as client:
        for name, path, body, param in cases(model):
            response = client.post(base_url + path, content=body,
                                   headers={"content-type": "application/json", **(headers or {})})
            error = response.json().get("error") if response.headers.get("content-type", "").startswith(
                "application/json") else None
            answers.append((name, response.status_code, error, param))
    return answers
