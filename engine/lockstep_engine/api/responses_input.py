"""The `/v1/responses` request body and its translation into a chat request.

A Responses request is a chat request spelled differently: `input` items become chat messages,
`instructions` a leading system message, `max_output_tokens` the token limit, `text.format` the
structured-output constraint and function tools the chat form of tools. The chat path then renders,
constrains and validates it, so both endpoints share every rule. Fields that need stored responses
or features this server lacks are refused with a 400 naming them, never dropped.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.openai_models import ChatCompletionRequest, OpenAIModel
from lockstep_engine.guided_schema import GuidedDecodingError, compile_json_schema

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")
TOOL_CHOICES = ("none", "auto", "required")
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key length, value length
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class ResponsesRequest(OpenAIModel):
    model: Optional[str] = None
    input: Any  # a string or a list of input items; checked by `chat_messages` so errors name the item
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[dict[str, Any]] = None  # its `effort` reaches the chat template as `reasoning_effort`
    store: Optional[bool] = None  # accepted; nothing is stored, every response says store: false
    previous_response_id: Optional[str] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[str] = None
    max_tool_calls: Optional[int] = None
    # vLLM's sampling extras, as on the chat endpoint.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None


def _refusals(body: ResponsesRequest) -> list[tuple[str, bool, str]]:
    """(field, refused?, why) for the fields this stateless server cannot honour."""
    return [
        ("previous_response_id", body.previous_response_id is not None,
         f"{body.previous_response_id!r} cannot be continued: this server does not store responses (every response "
         f"is store=false); send the earlier turns as input items instead"),
        ("conversation", body.conversation is not None,
         "conversations are not stored by this server; send the earlier turns as input items"),
        ("prompt", body.prompt is not None, "stored prompt templates are not available on this server"),
        ("background", bool(body.background), "background responses need stored responses, which this server "
                                               "does not keep; send background false"),
        ("include", bool(body.include), f"{body.include!r}: no extra output data is available (allowed: [])"),
        ("top_logprobs", bool(body.top_logprobs),
         "output logprobs are not returned by /v1/responses; use /v1/chat/completions with logprobs"),
        ("truncation", body.truncation not in (None, "disabled"),
         f"{body.truncation!r}: the input is never truncated (allowed: disabled); a too-long input is a 400"),
        ("max_tool_calls", body.max_tool_calls is not None, "the number of tool calls cannot be capped here"),
    ]


def check_supported(body: ResponsesRequest) -> None:
    for field, refused, why in _refusals(body):
        if refused:
            raise bad_request(f"{field}: {why}", field)
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata: at most {MAX_METADATA} pairs, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata: keys are at most {MAX_METADATA_KEY} characters and values at most "
                              f"{MAX_METADATA_VALUE} (key {key[:80]!r})", "metadata")


# ---- input items -> chat messages ----------------------------------------------------------------
def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts joined (images, files and audio are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}: expected a string or a list of content parts, got {type(content).__name__}",
                          param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.{j}: expected a text part {{'type': 'input_text' or 'output_text', "
                              f"'text': ...}}, got {kind or type(part).__name__!r} (only text is supported)",
                              f"{param}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key}: expected a string, got {type(value).__name__}", f"{param}.{key}")
    return value


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role: {role!r} is not allowed (allowed: {', '.join(ROLES)})", f"{param}.role")
    return {"role": ROLES[role], "content": _text(item.get("content"), f"{param}.content")}


def _function_call(item: dict, param: str) -> dict:
    return {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages; consecutive function calls form one assistant turn."""
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    items = body.input
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request(f"input: expected a string or a non-empty list of input items, got "
                          f"{type(items).__name__ if items != [] else 'an empty list'}", "input")
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise bad_request(f"{param}: expected an input item of type {', '.join(ITEM_TYPES)}, got "
                              f"{kind or type(item).__name__!r} (item references need stored responses)", param)
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            call = _function_call(item, param)
            if messages and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text(item.get("output"), f"{param}.output")})
    return messages


# ---- text.format, tools ------------------------------------------------------------------------
def text_format(body: ResponsesRequest) -> dict:
    """The request's `text.format`, checked (a schema is compiled once here so its error names this field)."""
    text = body.text or {}
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f"text.format.type: {kind!r} is not allowed (allowed: text, json_object, json_schema)",
                          "text.format.type")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format.schema: type 'json_schema' needs a JSON schema object", "text.format.schema")
        try:
            compile_json_schema(schema)
        except GuidedDecodingError as error:
            raise bad_request(f"text.format.schema: {error}", "text.format.schema") from None
    return fmt


def _response_format(fmt: dict) -> dict | None:
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}


def _chat_tool(tool: Any, param: str) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"{param}: tools of type {kind or type(tool).__name__!r} are not supported (allowed: "
                          f"function, as {{'type': 'function', 'name': ..., 'parameters': {{...}}}})", param)
    name, parameters = tool.get("name"), tool.get("parameters")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{param}.name: expected the function's name, got {name!r}", f"{param}.name")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{param}.parameters: expected a JSON schema object", f"{param}.parameters")
    function = {"name": name, "parameters": parameters}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"tool_choice={choice!r} is not allowed (allowed: none, auto, required or "
                      f"{{'type': 'function', 'name': ...}})", "tool_choice")


def chat_request(body: ResponsesRequest, fmt: dict) -> ChatCompletionRequest:
    tools = None if body.tools is None else [_chat_tool(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": chat_messages(body), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "stream": body.stream,
        "response_format": _response_format(fmt), "tools": tools, "tool_choice": _chat_tool_choice(body.tool_choice),
        "user": body.user, "parallel_tool_calls": body.parallel_tool_calls,
        "reasoning_effort": (body.reasoning or {}).get("effort")})
