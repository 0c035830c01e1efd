"""`/v1/messages`: Anthropic's Messages API over the chat path (as vLLM serves it).

The request is translated into a chat request: `system` becomes a leading system message, text
blocks the message text, `tool_use` blocks an assistant's tool calls and `tool_result` blocks tool
messages, `tools` the chat form of tools and `tool_choice` its chat spelling (auto, any ->
required, tool -> a named function). So rendering, sampling, tool parsing and validation follow the
chat endpoint's rules. The answer is a `message` with text, `tool_use` (and, with
`--reasoning-parser`, `thinking`) blocks, Anthropic's `stop_reason` and usage, or a stream of
Anthropic's events: `message_start`, `ping`, per block `content_block_start`,
`content_block_delta`..., `content_block_stop`, then `message_delta` and `message_stop`. Errors,
streamed or not, are Anthropic's shape (lockstep_common/anthropic_errors.py rewrites the server's
own for these paths).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from pydantic import ValidationError
from lockstep_common.anthropic_errors import anthropic_error_body
from starlette.responses import JSONResponse

from lockstep_engine.api import reasoning, tools
from lockstep_engine.api.client import EngineDeadError, Generation, RequestRejected
from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.openai_models import ChatCompletionRequest, OpenAIModel
from lockstep_engine.api.sse import SSE_HEADERS, EventStreamResponse, compact_json

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# vLLM's sampling extras, read from the body as on the chat endpoint (the `anthropic` SDK sends them as extra_body).
SAMPLING_EXTRAS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
                   "min_tokens", "logit_bias", "bad_words", "allowed_token_ids", "structured_outputs", "guided_json",
                   "guided_regex", "guided_choice", "guided_grammar", "skip_special_tokens",
                   "include_stop_str_in_output", "priority", "stop_token_ids")


class MessagesRequest(OpenAIModel):
    model: Optional[str] = None  # Anthropic requires it; here the first served name is the default, as on /v1/chat
    messages: Any  # a list of {role, content}; checked by `chat_messages` so errors name the block
    max_tokens: int
    system: Optional[Union[str, list[Any]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    metadata: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None  # accepted; with --reasoning-parser the reasoning comes back


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ---- request -> chat request ---------------------------------------------------------------------
def _text(content: Any, param: str) -> list[dict]:
    """Text content (a string or a list of text blocks) as chat text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{param}: expected a string or a list of text blocks, got {type(content).__name__}", param)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{param}.{i}: expected a text block {{'type': 'text', 'text': ...}}, got {kind!r}",
                              f"{param}.{i}")
        parts.append({"type": "text", "text": block["text"]})
    return parts


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad_request(f"{where}: a tool_use block needs a string id and name", where)
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input: expected an object, got {type(arguments).__name__}", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{where}.tool_use_id: expected the id of the tool_use block it answers", where)
    text = "".join(part["text"] for part in _text(block.get("content", ""), f"{where}.content"))
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _message(message: Any, index: int) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results come first, as tool messages."""
    where = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}: expected {{'role': 'user' or 'assistant', 'content': ...}}", where)
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or a list of content blocks", f"{where}.content")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text":
            texts += _text([block], f"{where}.content")
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again (chat templates drop it too)
        else:
            raise bad_request(f"{at}: content blocks of type {kind!r} are not supported here (allowed: text; "
                              f"tool_use in assistant turns; tool_result in user turns; no images or documents)", at)
    chat = list(results)
    if role == "assistant":
        chat.append({"role": "assistant", "content": texts, **({"tool_calls": calls} if calls else {})})
    elif texts or not results:
        chat.append({"role": "user", "content": texts})
    return chat


def _chat_tool(tool: Any, index: int) -> dict:
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad_request(f"{where}: tools of type {kind!r} are not supported (allowed: client tools, "
                          f"{{'name': ..., 'input_schema': {{...}}}})", where)
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name: expected the tool's name", f"{where}.name")
    schema = tool.get("input_schema", {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.input_schema: expected a JSON schema object", f"{where}.input_schema")
    function = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind], parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice: type {kind!r} is not allowed (allowed: auto, any, tool, none)", "tool_choice")


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    if not isinstance(body.messages, list) or not body.messages:
        raise bad_request("messages: expected a non-empty list of messages", "messages")
    messages = [] if body.system is None else [{"role": "system", "content": _text(body.system, "system")}]
    for index, message in enumerate(body.messages):
        messages += _message(message, index)
    tool_choice, parallel = _chat_tool_choice(body.tool_choice)
    user = (body.metadata or {}).get("user_id")
    extras = {name: value for name, value in (body.model_extra or {}).items() if name in SAMPLING_EXTRAS}
    fields = {
        **extras, "model": body.model, "messages": messages, "max_tokens": body.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences,
        "stream": body.stream,
        "tools": None if body.tools is None else [_chat_tool(tool, i) for i, tool in enumerate(body.tools)],
        "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "user": user if isinstance(user, str) else None}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # a vLLM extra of the wrong type: named by its field, as on chat
        raise _invalid(error) from None


def _invalid(error: ValidationError):
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ())) or "body"
    return bad_request(f"{where}: {first.get('msg', 'invalid')}", where)


# ---- the answer ----------------------------------------------------------------------------------
def _stop_reason(seq, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished sample."""
    if seq.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(seq.stop_reason, str):
        return "stop_sequence", seq.stop_reason
    return "end_turn", None


def _tool_use(call) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:  # cut short by max_tokens
        arguments = {}
    return {"type": "tool_use", "id": _new_id("toolu"), "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


@dataclass
class _Reply:
    message_id: str
    model: str
    generation: Generation
    tool_call: tools.ToolCalling | None
    reasoning_parser: str | None
    index: int = 0  # the next content block's index (streamed)
    open_block: str | None = None  # the streamed block now open: "text" or "thinking"
    stream: reasoning.ReasoningStream | None = None  # with --reasoning-parser
    sent: int = 0  # streamed text sent (without a reasoning parser)

    @property
    def sequence(self):
        return self.generation.states[0].sequences[0]

    def usage(self) -> dict:
        state = self.generation.states[0]
        cached = state.num_cached_tokens or 0
        # Anthropic's split: input_tokens are the prompt tokens not read from the prefix cache
        return {"input_tokens": len(state.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": len(self.sequence.token_ids)}

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self.usage()}

    def blocks(self, thinking: str | None, text: str | None) -> tuple[list[dict], bool]:
        """The content blocks of a finished sample, given its reasoning and its other text; and whether it
        called a tool."""
        blocks = [_thinking(thinking)] if thinking else []
        if self.tool_call is None:
            return blocks + ([{"type": "text", "text": text}] if text or not blocks else []), False
        content, calls = self.tool_call.calls_from_text(text or "")
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [_tool_use(call) for call in calls]
        return blocks, bool(calls)

    def finished_message(self) -> dict:
        text = self.sequence.text
        thinking, content = reasoning.split(self.reasoning_parser, text) if self.reasoning_parser else (None, text)
        blocks, called = self.blocks(thinking, content)
        return self.message(blocks, *_stop_reason(self.sequence, called))


def event(kind: str, **fields) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {compact_json(payload)}\n\n"


def error_event(status: int, message: str) -> str:
    return event("error", error=anthropic_error_body(status, message)["error"])


def _open(reply: _Reply, kind: str) -> str:
    """Closes the open block unless it is of `kind`, and opens one of `kind`."""
    if reply.open_block == kind:
        return ""
    out = _close(reply)
    reply.open_block = kind
    start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
    return out + event("content_block_start", index=reply.index, content_block=start)


def _close(reply: _Reply) -> str:
    if reply.open_block is None:
        return ""
    reply.open_block = None
    reply.index += 1
    return event("content_block_stop", index=reply.index - 1)


def _deltas(reply: _Reply, thinking: str, text: str) -> str:
    out = ""
    if thinking:
        out += _open(reply, "thinking") + event("content_block_delta", index=reply.index,
                                                delta={"type": "thinking_delta", "thinking": thinking})
    if text:
        out += _open(reply, "text") + event("content_block_delta", index=reply.index,
                                            delta={"type": "text_delta", "text": text})
    return out


def _whole_block(reply: _Reply, block: dict) -> str:
    """A block sent at once (tool calls are parsed only from the finished text)."""
    if block["type"] == "tool_use":
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    elif block["type"] == "thinking":
        start, delta = _thinking(""), {"type": "thinking_delta", "thinking": block["thinking"]}
    else:
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    out = event("content_block_start", index=reply.index, content_block=start)
    out += event("content_block_delta", index=reply.index, delta=delta)
    out += event("content_block_stop", index=reply.index)
    reply.index += 1
    return out


async def _events(serving, reply: _Reply) -> AsyncIterator[str]:
    generation = reply.generation
    completed = False
    try:
        start = reply.message([], None, None)
        yield event("message_start", message={**start, "usage": {**start["usage"], "output_tokens": 0}}) + \
            event("ping")
        streams_text = reply.tool_call is None
        while True:
            if streams_text:
                text = reply.sequence.releasable_text()
                if reply.stream is not None:
                    thinking, new_text = reply.stream.feed(0, text, generation.finished)
                else:
                    thinking, new_text, reply.sent = "", text[reply.sent:], len(text)
                out = _deltas(reply, thinking, new_text)
                if out:
                    yield out
            if generation.finished:
                break
            await generation.next_update(serving.idle_timeout_s)
        completed = True
        if streams_text:
            tail = (_open(reply, "text") if reply.index == 0 and reply.open_block is None else "") + _close(reply)
            stop_reason, stop_sequence = _stop_reason(reply.sequence, False)
        else:
            message = reply.finished_message()
            tail = "".join(_whole_block(reply, block) for block in message["content"])
            stop_reason, stop_sequence = message["stop_reason"], message["stop_sequence"]
        yield tail + event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           usage=reply.usage()) + event("message_stop")
    except RequestRejected as error:
        completed = True
        yield error_event(400, str(error))
    except EngineDeadError as error:
        completed = True
        yield error_event(503, str(error))
    except RuntimeError as error:
        completed = True
        yield error_event(500, str(error))
    finally:
        # A client gone mid-stream lands here via cancellation: free its blocks.
        if completed and generation.finished:
            serving.client.release(generation)
        else:
            serving.client.abort(generation)


# ---- the route -----------------------------------------------------------------------------------
def _prepare(serving, body: MessagesRequest):
    """Checks and renders the request (tokenizing takes a while, so this runs off the event loop)."""
    chat = chat_request(body)
    tool_call = tools.ToolCalling.of(chat, serving.tool_call_parser)
    prompt = serving.chat_prompt(chat.messages, True, False, tools.template_kwargs(chat))
    constraint = serving.guided_constraint(chat)
    params = serving.sampling_params(chat, chat.max_tokens, None, constraint)
    serving.validate([prompt], params)
    serving.grammars.check_blocking(constraint)
    return tool_call, prompt, params


async def create_message(serving, body: MessagesRequest, request: Request):
    lora_name = serving.check_model(body.model)
    tool_call, prompt, params = await asyncio.to_thread(_prepare, serving, body)
    _, generation = serving.submit("msg", [prompt], [None], params, lora_name=lora_name)
    parser = getattr(serving, "reasoning_parser", None)
    reply = _Reply(_new_id("msg"), body.model or serving.model_name, generation, tool_call, parser,
                   stream=reasoning.ReasoningStream(parser) if parser else None)
    if body.stream:
        return EventStreamResponse(_events(serving, reply), media_type="text/event-stream", headers=SSE_HEADERS)
    await serving._wait_finished(reply, request)  # the chat path's wait: disconnects, timeouts, core errors
    return JSONResponse(reply.finished_message())


def count_tokens(serving, body: dict) -> dict:
    """`/v1/messages/count_tokens`: the rendered prompt's length, as Anthropic counts `input_tokens`."""
    try:
        request = MessagesRequest.model_validate({"max_tokens": 1, **body})
    except ValidationError as error:
        raise _invalid(error) from None
    chat = chat_request(request)
    tools.ToolCalling.of(chat, serving.tool_call_parser)
    return {"input_tokens": len(serving.chat_prompt(chat.messages, True, False, tools.template_kwargs(chat)))}


def register(app: FastAPI, state, error_responses: dict) -> None:
    """Adds the /v1/messages routes to the engine server's app."""

    @app.post("/v1/messages", responses=error_responses)
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(state.require_serving(), body, request)

    @app.post("/v1/messages/count_tokens", responses=error_responses)
    async def messages_count_tokens(body: dict[str, Any]):
        serving = state.require_serving()
        serving.check_model(body.get("model"))
        return JSONResponse(await asyncio.to_thread(count_tokens, serving, body))

