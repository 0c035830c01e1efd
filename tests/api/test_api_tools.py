"""Tool calling: parsers on real text, and named / required / auto through real servers with the openai client."""

import json

import httpx
import jsonschema
import pytest

from lockstep_engine.api.tool_parsers import hermes, llama3_json, pythonic

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- parsers ------------------------------------------------------------------------------------
def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "UTC"})]
    assert hermes("No tools needed: 4.") == ("No tools needed: 4.", [])
    assert hermes("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_llama3_json_parser():
    content, calls = llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo", "unit": "f"})]
    assert llama3_json("The answer is {x}") == ("The answer is {x}", [])


def test_pythonic_parser():
    content, calls = pythonic('[get_weather(city="Paris", unit="c"), get_time(zone="UTC")]')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "UTC"})]
    assert pythonic("[1, 2, 3]") == ("[1, 2, 3]", [])
    assert pythonic("[f(x)]") == ("[f(x)]", [])


# ---- named and required, through structured outputs ---------------------------------------------
@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_named_tool_choice_calls_that_function_with_valid_arguments(server_name, request):
    client = request.getfixturevalue(server_name).client()
    response = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0.7, seed=2, n=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in response.choices:
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_required_tool_choice_calls_one_of_the_tools(server_name, request):
    client = request.getfixturevalue(server_name).client()
    response = client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                              temperature=0, tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("server_name", ["smol8", "smol1"])
def test_streamed_tool_call_deltas(server_name, request):
    client = request.getfixturevalue(server_name).client()
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        whole = client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                               temperature=0, tool_choice=tool_choice)
        chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS,
                                                     max_tokens=60, temperature=0, tool_choice=tool_choice,
                                                     stream=True))
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                if delta.function.name:
                    assert delta.id and delta.type == "function"
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
        expected = [{"name": c.function.name, "arguments": c.function.arguments}
                    for c in whole.choices[0].message.tool_calls]
        assert [calls[i] for i in sorted(calls)] == expected


def test_tool_choice_none_and_bad_tool_choices(smol8):
    client = smol8.client()
    plain = client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    for body, words in ((
            {"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
            ({"tool_choice": "required"}, "needs tools"),
            ({"tools": [{"type": "function", "function": {}}]}, "tools[0]")):
        response = httpx.post(f"{smol8.url}/v1/chat/completions", timeout=30,
                              json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 4, **body})
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def test_history_tool_calls_and_results_reach_the_chat_template(servers):
    """A template that prints tool calls and results: the prompt's token count shows they were rendered."""
    server = servers("smoltools")
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]"
                "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}")
    # (the newline as an expression: chat templates render with trim_blocks, as Hugging Face does)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "18 degrees"}]
    response = server.client().chat.completions.create(
        model="smollm2", messages=history, max_tokens=4, temperature=0, tools=TOOLS,
        extra_body={"chat_template_kwargs": {"chat_template": template}, "add_generation_prompt": False})
    rendered = ("user:What is the weather in Paris?\nassistant:[get_weather(Paris)]\n"
                "tool:18 degrees#call1\n")
    count = httpx.post(f"{server.url}/tokenize", timeout=30,
                       json={"prompt": rendered, "add_special_tokens": False}).json()["count"]
    assert response.usage.prompt_tokens == count


# ---- auto, through the hermes parser --------------------------------------------------------------
def test_auto_tool_choice_with_the_hermes_parser(servers):
    """SmolLM2 does not call tools by itself, so a regex makes it write a hermes call: the parser path runs."""
    server = servers("smoltools")
    client = server.client()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    regex = "Checking\\.\n" + "".join("\\" + ch if ch in "{}[]().*+?|\\^$" else ch for ch in call)
    response = client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                              max_tokens=60, temperature=0, extra_body={"guided_regex": regex})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "unit": "c"}
    plain = client.chat.completions.create(model="smollm2", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason in ("stop", "length")
