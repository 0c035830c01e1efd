"""Tool calling on /v1/chat/completions, as vLLM does it.

`tool_choice` a named function or "required" constrains the output with a JSON schema built from
the tools' parameters (structured outputs, so any model calls tools); "auto" lets the model write
and a tool-call parser (`--tool-call-parser`, see tool_parsers.py) finds the calls in its text;
"none" leaves the text alone. Tool results (`role: tool`) and earlier assistant `tool_calls` go to
the chat template, which decides how the model sees them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.tool_parsers import ToolCall, parse_tool_calls


def _tool_names(tools: list[dict]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': {{...}}}}}}", f"tools.{i}")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters: expected a JSON schema object", f"tools.{i}")
        names.append(function["name"])
    return names


def _parameters(tool: dict) -> dict:
    return closed_schema(tool["function"].get("parameters") or {"type": "object", "properties": {}})


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def response_schema(fmt) -> dict:
    """`response_format.json_schema`'s schema; closed with `strict: true`, as OpenAI's strict mode."""
    return closed_schema(fmt.json_schema) if fmt.strict else fmt.json_schema


def closed_schema(schema):
    """A copy of `schema` where every object that lists its properties and says nothing of others
    (no `additionalProperties`, `patternProperties` or `unevaluatedProperties`) admits no other keys:
    OpenAI's strict mode, and vLLM's default backend for tool parameters. Subschemas of an `allOf` stay
    as written (closing each part would refuse the keys of the others). A walk with a stack of its own:
    a client's schema may nest deeper than Python's recursion limit."""
    if not isinstance(schema, dict):
        return schema
    root = dict(schema)
    stack = [root]
    while stack:
        closed = stack.pop()
        for key in _SUBSCHEMA_MAPS:
            if isinstance(closed.get(key), dict):
                closed[key] = {name: _copied(sub, stack) for name, sub in closed[key].items()}
        for key in _SUBSCHEMA_LISTS:
            if isinstance(closed.get(key), list):
                closed[key] = [_copied(sub, stack) for sub in closed[key]]
        for key in ("items", "additionalProperties", "not"):
            if isinstance(closed.get(key), dict):
                closed[key] = _copied(closed[key], stack)
        if isinstance(closed.get("properties"), dict) and not any(
                key in closed for key in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
            closed["additionalProperties"] = False
    return root


def _copied(sub, stack: list):
    """A subschema's copy, queued to be closed in turn (anything but an object stays as it is)."""
    if not isinstance(sub, dict):
        return sub
    copy = dict(sub)
    stack.append(copy)
    return copy


def mode(body) -> str | None:
    """none / auto / required / named, or None without tools; 400 on a bad tool_choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice={choice!r} needs tools", "tool_choice")
        return None
    names = _tool_names(body.tools)
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice={choice!r} is invalid: expected none, auto, required or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
        return choice
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("tool_choice: expected none, auto, required or {'type': 'function', 'function': "
                          "{'name': ...}}", "tool_choice")
    name = function["name"]
    if name not in names:
        raise bad_request(f"tool_choice: function {name!r} is not among tools ({', '.join(names)})", "tool_choice")
    return "named"


def _named_tool(body) -> dict:
    name = body.tool_choice["function"]["name"]
    return next(tool for tool in body.tools if tool["function"]["name"] == name)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """A non-empty JSON array of {name, parameters} calls, each one of the tools (vLLM's schema, closed);
    one call at most with parallel_tool_calls false."""
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                          "parameters": _parameters(tool)},
         # Closed objects: a small model otherwise keeps adding keys after the parameters.
         "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]}}


def forced_specs(body) -> list[tuple[str, dict]]:
    """The structured-output constraint that tool_choice named / required puts on the request."""
    if not getattr(body, "tools", None):
        return []
    current = mode(body)
    if current == "named":
        return [("tool_choice", {"json": _parameters(_named_tool(body))})]
    if current == "required":
        return [("tool_choice", {"json": required_schema(body.tools, body.parallel_tool_calls is not False)})]
    return []


def template_kwargs(body) -> dict:
    """chat_template_kwargs plus the tools, `documents` and `reasoning_effort`, which chat templates take
    under those names (as vLLM passes them; a template that does not read one renders without it)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.tools:
        kwargs.setdefault("tools", body.tools)
    for name in ("documents", "reasoning_effort"):
        value = getattr(body, name, None)
        if value is not None:
            kwargs.setdefault(name, value)
    return kwargs


def _checked_tool_calls(calls, index: int) -> list[dict]:
    """A history message's `tool_calls`, each checked before a chat template iterates it (a 400 naming it)."""
    param = f"messages.{index}.tool_calls"
    if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
        raise bad_request(f"{param}: expected a list of {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                          f"'arguments': ...}}}} objects, got {type(calls).__name__}", param)
    for j, call in enumerate(calls):
        function, where = call.get("function"), f"{param}.{j}.function"
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), (str, dict)):
            raise bad_request(f"{where}: expected {{'name': a string, 'arguments': a JSON string or object}}, got "
                              f"{type(function).__name__}", where)
    return calls


def template_message(message, text: str, index: int = 0) -> dict:
    """One history message (`messages[index]`) for the chat template, with tool calls (arguments as
    objects) and tool results; 400 on a tool field of the wrong type."""
    rendered = {"role": message.role, "content": text}
    extra = message.model_extra or {}
    if message.name is not None:
        rendered["name"] = message.name
    call_id = extra.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise bad_request(f"messages.{index}.tool_call_id: expected a string, got {type(call_id).__name__}",
                              f"messages.{index}.tool_call_id")
        rendered["tool_call_id"] = call_id
    calls = extra.get("tool_calls")
    if calls is not None and _checked_tool_calls(calls, index):  # an empty list renders as none, as before
        rendered["tool_calls"] = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                # HF chat templates iterate arguments as a mapping; vLLM hands them over parsed too.
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            rendered["tool_calls"].append({**call, "function": function})
    return rendered


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _wire(call: ToolCall, index: int | None = None) -> dict:
    wire = {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        wire["index"] = index
    return wire


@dataclass
class ToolCalling:
    """How one chat request's tool calls are made and read; None (no object) when it has no tools."""

    mode: str  # auto / required / named
    body: object
    parser: str | None
    text: dict = field(default_factory=dict)  # streamed: sample index -> text so far
    started: set = field(default_factory=set)  # streamed: samples whose named call has been announced

    @classmethod
    def of(cls, body, parser: str | None) -> ToolCalling | None:
        current = mode(body)
        if current in (None, "none"):
            return None
        if current == "auto" and parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set', "tool_choice")
        return cls(current, body, parser)

    def calls_from_text(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content left for the message, tool calls) for a finished sample's text; one call at most
        with parallel_tool_calls false (vLLM keeps the first)."""
        content, calls = self._calls(text)
        if getattr(self.body, "parallel_tool_calls", True) is False:
            calls = calls[:1]
        return content, calls

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            return None, [ToolCall(_named_tool(self.body)["function"]["name"], text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: still tool calls, the last one's arguments cut
                cut = _cut_calls(text)
                return (None if cut else text), cut
            return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        return parse_tool_calls(self.parser, text)


_CALL_START = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


def _cut_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` array that max_tokens cut short: each whole one, then the cut one with
    the arguments written so far (as a named call cut short keeps its partial arguments)."""
    calls = []
    decoder = json.JSONDecoder()
    for match in _CALL_START.finditer(text):
        name = json.loads(f'"{match.group(1)}"')
        try:
            arguments, _ = decoder.raw_decode(text, match.end())
        except json.JSONDecodeError:
            calls.append(ToolCall(name, text[match.end():]))
            break
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def message(tool_call: ToolCalling | None, text: str, finish_reason) -> tuple[dict, str | None]:
    """The chat choice's message and finish_reason for a finished sample."""
    if tool_call is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = tool_call.calls_from_text(text)
    result = {"role": "assistant", "content": content, "tool_calls": [_wire(call) for call in calls]}
    if calls and tool_call.mode != "named" and finish_reason == "stop":
        finish_reason = "tool_calls"
    return result, finish_reason


def stream_delta(tool_call: ToolCalling | None, index: int, delta: str, finishing: bool, finish_reason):
    """(delta dict or None to send nothing yet, finish_reason) for one streamed chunk of sample `index`,
    in vLLM's tool-call delta shape.

    A named call streams its arguments as they come; required and auto calls are sent whole when
    the sample finishes (their text is parsed only then), with any plain content before them.
    """
    if tool_call is None:
        return ({"content": delta} if delta or not finishing else {}), finish_reason
    if tool_call.mode == "named":
        if index not in tool_call.started:
            tool_call.started.add(index)
            name = _named_tool(tool_call.body)["function"]["name"]
            return {"tool_calls": [{"index": 0, "id": _call_id(), "type": "function",
                                    "function": {"name": name, "arguments": delta}}]}, finish_reason
        return ({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}), finish_reason
    tool_call.text[index] = tool_call.text.get(index, "") + delta
    if not finishing:
        return None, None
    content, calls = tool_call.calls_from_text(tool_call.text[index])
    out: dict = {}
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = [_wire(call, i) for i, call in enumerate(calls)]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return out, finish_reason
