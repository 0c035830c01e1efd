"""Tool-call parsers for tool_choice "auto", named as vLLM's `--tool-call-parser` names them.

Each takes a finished completion's text and returns (content, calls): the plain text the model
wrote besides its calls (None when there is none) and the calls with arguments as JSON strings.
Text that does not parse as the format's calls is content, never an error: the model chose not
to call a tool.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as the OpenAI API carries it


def _call(obj, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = _call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x JSON calls: optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects
    separated by `;`."""
    stripped = text.strip()
    if stripped.startswith("<|python_tag|>"):
        stripped = stripped[len("<|python_tag|>"):].lstrip()
    if not stripped.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while position < len(stripped):
        try:
            obj, end = decoder.raw_decode(stripped, position)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(stripped) and stripped[position] in " \t\n;":
            position += 1
    return None, calls


def _literal(node: ast.AST):
    return ast.literal_eval(node)


def pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.2 / 4 pythonic calls: `[get_weather(city="Paris"), get_time()]` with literal arguments."""
    stripped = text.strip()
    if stripped.startswith("<|python_start|>"):
        stripped = stripped[len("<|python_start|>"):].removesuffix("<|python_end|>").strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return text, []
    try:
        tree = ast.parse(stripped, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) and isinstance(e.func, ast.Name)
                                                 for e in tree.elts):
        return text, []
    calls = []
    for element in tree.elts:
        if element.args:  # calls name their arguments; a positional one is not a tool call
            return text, []
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in element.keywords}
        except ValueError:
            return text, []
        calls.append(ToolCall(element.func.id, json.dumps(arguments, ensure_ascii=False)))
    return None, calls


PARSERS = {"hermes": hermes, "llama3_json": llama3_json, "pythonic": pythonic}


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    return PARSERS[parser](text)
