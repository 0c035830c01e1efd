"""`/v1/responses`: OpenAI's Responses API over the chat path, stateless (vLLM's default, `store` off).

The request is translated into a chat request (`responses_input.py`), so rendering, sampling,
structured outputs and tool calls follow the chat endpoint's rules; what differs is the answer: a
`response` object whose `output` holds a `message` item (and `function_call` items), and a stream
of typed events, each with its `sequence_number`, from `response.created` to `response.completed`
(or `response.incomplete` when `max_output_tokens` cut the text short, as OpenAI sends it).
Nothing is stored: `previous_response_id` is a 400 and `GET /v1/responses/{id}` a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from lockstep_engine.api import reasoning, tools
from lockstep_engine.api.client import EngineDeadError, Generation, RequestRejected
from lockstep_engine.api.errors import APIError, error_body
from lockstep_engine.api.responses_input import ResponsesRequest, chat_request, check_supported, text_format
from lockstep_engine.api.sse import SSE_HEADERS, EventStreamResponse, compact_json

# Chat-path field names in error messages, as this endpoint calls them.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "messages": "input", "prompt": "input", "response_format": "text.format"}
# finish_reason -> the response's status.
_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


@contextlib.contextmanager
def _responses_field_names():
    """Re-raises a chat-path 400 with this endpoint's field name (`max_output_tokens`, not `max_tokens`)."""
    try:
        yield
    except APIError as error:
        name = _FIELD_NAMES.get(error.param)
        if name is None:
            raise
        message = re.sub(rf"\b{re.escape(error.param)}\b", name, error.message)
        raise APIError(error.status, message, name, error.headers) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Reply:
    """One /v1/responses request in flight: what its response object and events are built from."""

    body: ResponsesRequest
    fmt: dict  # text.format as given (default {"type": "text"})
    response_id: str
    created_at: int
    model: str
    generation: Generation
    temperature: float
    top_p: float
    tool_call: tools.ToolCalling | None
    reasoning_parser: str | None = None  # --reasoning-parser: the <think> text is a reasoning item
    message_id: str = field(default_factory=lambda: _new_id("msg"))
    reasoning_id: str = field(default_factory=lambda: _new_id("rs"))
    sequence_number: int = 0

    @property
    def sequence(self):
        return self.generation.states[0].sequences[0]

    def usage(self) -> dict:
        state = self.generation.states[0]
        input_tokens, output_tokens = len(state.prompt_token_ids), len(self.sequence.token_ids)
        return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": state.num_cached_tokens},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens}

    def response(self, status: str, output: list[dict]) -> dict:
        body = self.body
        done = status != "in_progress"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": self.temperature, "text": {"format": self.fmt},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": self.top_p,
            "truncation": "disabled", "usage": self.usage() if done else None, "user": body.user}

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [_text_part(text)]}

    def reasoning_item(self, text: str, status: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}

    def output(self, status: str, parts: tuple[str | None, str] | None = None) -> list[dict]:
        """The finished output items: the reasoning (with --reasoning-parser), the message, and with tools the
        calls read from the text. `parts`: (reasoning, text) as a stream split them."""
        text, thinking = self.sequence.text, None
        if parts is not None:
            thinking, text = parts
        elif self.reasoning_parser is not None:
            thinking, text = reasoning.split(self.reasoning_parser, text)
            text = text or ""
        item_status = "completed" if status == "completed" else "incomplete"
        items = [self.reasoning_item(thinking, item_status)] if thinking else []
        if self.tool_call is None:
            return items + [self.message(text, item_status)]
        content, calls = self.tool_call.calls_from_text(text)
        items += [self.message(content, item_status)] if content else []
        items += [{"type": "function_call", "id": _new_id("fc"), "call_id": _new_id("call"), "name": call.name,
                   "arguments": call.arguments, "status": item_status} for call in calls]
        return items

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {compact_json(payload)}\n\n"

    def error_event(self, status: int, message: str, param: str | None = None) -> str:
        """OpenAI's `error` event; its `error` object also makes the openai SDK raise APIError mid-stream."""
        error = error_body(status, message, param)["error"]
        return self.event("error", code=error["type"], message=message, param=param, error=error)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(finish_reason: str | None) -> str:
    return _STATUS.get(finish_reason, "completed")


# ---- streaming -----------------------------------------------------------------------------------
def _message_opening(reply: _Reply, index: int) -> str:
    item = {**reply.message("", "in_progress"), "content": []}
    return (reply.event("response.output_item.added", output_index=index, item=item)
            + reply.event("response.content_part.added", item_id=reply.message_id, output_index=index,
                          content_index=0, part=_text_part("")))


def _text_delta(reply: _Reply, index: int, delta: str) -> str:
    return reply.event("response.output_text.delta", item_id=reply.message_id, output_index=index, content_index=0,
                       delta=delta, logprobs=[])


def _message_closing(reply: _Reply, index: int, item: dict) -> str:
    part = item["content"][0]
    return (reply.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
            + reply.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part)
            + reply.event("response.output_item.done", output_index=index, item=item))


def _reasoning_opening(reply: _Reply, index: int) -> str:
    item = {**reply.reasoning_item("", "in_progress"), "content": []}
    return (reply.event("response.output_item.added", output_index=index, item=item)
            + reply.event("response.content_part.added", item_id=reply.reasoning_id, output_index=index,
                          content_index=0, part={"type": "reasoning_text", "text": ""}))


def _reasoning_delta(reply: _Reply, index: int, delta: str) -> str:
    return reply.event("response.reasoning_text.delta", item_id=reply.reasoning_id, output_index=index,
                       content_index=0, delta=delta)


def _reasoning_closing(reply: _Reply, index: int, item: dict) -> str:
    part = item["content"][0]
    return (reply.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"])
            + reply.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part)
            + reply.event("response.output_item.done", output_index=index, item=item))


def _whole_item(reply: _Reply, index: int, item: dict) -> str:
    """The events of an item sent at once (tool-call output is parsed only when the text is complete)."""
    if item["type"] == "reasoning":
        return _reasoning_opening(reply, index) + _reasoning_delta(reply, index, item["content"][0]["text"]) + \
            _reasoning_closing(reply, index, item)
    if item["type"] == "message":
        return _message_opening(reply, index) + _text_delta(reply, index, item["content"][0]["text"]) + \
            _message_closing(reply, index, item)
    return (reply.event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            + reply.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"])
            + reply.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"])
            + reply.event("response.output_item.done", output_index=index, item=item))


async def _events(serving, reply: _Reply) -> AsyncIterator[str]:
    generation = reply.generation
    completed = False
    try:
        started = reply.response("in_progress", [])
        yield reply.event("response.created", response=started) + reply.event("response.in_progress",
                                                                                response=started)
        streams_text = reply.tool_call is None
        if streams_text and reply.reasoning_parser is not None:
            async for events in _reasoning_events(serving, reply):
                yield events
            completed = True
            return
        if streams_text:
            yield _message_opening(reply, 0)
        sent = 0
        while True:
            if streams_text:
                text = reply.sequence.releasable_text()
                if len(text) > sent:
                    yield _text_delta(reply, 0, text[sent:])
                    sent = len(text)
            if generation.finished:
                break
            await generation.next_update(serving.idle_timeout_s)
        completed = True
        status = _status(reply.sequence.finish_reason)
        output = reply.output(status)
        if streams_text:
            tail = _message_closing(reply, 0, output[0])
        else:
            tail = "".join(_whole_item(reply, index, item) for index, item in enumerate(output))
        final = "response.completed" if status == "completed" else "response.incomplete"
        yield tail + reply.event(final, response=reply.response(status, output))
    except RequestRejected as error:
        completed = True
        yield reply.error_event(400, str(error), error.param)
    except EngineDeadError as error:
        completed = True
        yield reply.error_event(503, str(error))
    except RuntimeError as error:
        completed = True
        yield reply.error_event(500, str(error))
    finally:
        # A client gone mid-stream lands here via cancellation: free its blocks.
        if completed and generation.finished:
            serving.client.release(generation)
        else:
            serving.client.abort(generation)


async def _reasoning_events(serving, reply: _Reply) -> AsyncIterator[str]:
    """A streamed text answer with --reasoning-parser: the reasoning item's deltas, then the message's."""
    generation = reply.generation
    stream = reasoning.ReasoningStream(reply.reasoning_parser)
    thinking, text = "", ""
    message_index = None  # once the message is open
    while True:
        new_thinking, new_text = stream.feed(0, reply.sequence.releasable_text(), generation.finished)
        out = ""
        if new_thinking and message_index is None:
            out += (_reasoning_opening(reply, 0) if not thinking else "") + _reasoning_delta(reply, 0, new_thinking)
            thinking += new_thinking
        if new_text:
            if message_index is None:
                if thinking:
                    out += _reasoning_closing(reply, 0, reply.reasoning_item(thinking, "completed"))
                message_index = 1 if thinking else 0
                out += _message_opening(reply, message_index)
            out += _text_delta(reply, message_index, new_text)
            text += new_text
        if out:
            yield out
        if generation.finished:
            break
        await generation.next_update(serving.idle_timeout_s)
    status = _status(reply.sequence.finish_reason)
    output = reply.output(status, (thinking or None, text))
    tail = ""
    if message_index is None:
        if thinking:
            tail += _reasoning_closing(reply, 0, output[0])
        message_index = 1 if thinking else 0
        tail += _message_opening(reply, message_index)
    final = "response.completed" if status == "completed" else "response.incomplete"
    yield tail + _message_closing(reply, message_index, output[-1]) + reply.event(final,
                                                                               response=reply.response(status, output))


# ---- the route -----------------------------------------------------------------------------------
def _prepare(serving, body: ResponsesRequest):
    """Checks and renders the request (tokenizing takes a while, so this runs off the event loop)."""
    check_supported(body)
    fmt = text_format(body)
    chat = chat_request(body, fmt)
    with _responses_field_names():
        tool_call = tools.ToolCalling.of(chat, serving.tool_call_parser)
        prompt = serving.chat_prompt(chat.messages, True, False, tools.template_kwargs(chat))
        constraint = serving.guided_constraint(chat)
        params = serving.sampling_params(chat, chat.max_completion_tokens, None, constraint)
        serving.validate([prompt], params)
        serving.grammars.check_blocking(constraint)
    return fmt, tool_call, prompt, params


async def create_response(serving, body: ResponsesRequest, request: Request):
    lora_name = serving.check_model(body.model)
    fmt, tool_call, prompt, params = await asyncio.to_thread(_prepare, serving, body)
    _, generation = serving.submit("resp", [prompt], [None], params, lora_name=lora_name)
    reply = _Reply(body, fmt, _new_id("resp"), int(time.time()), body.model or serving.model_name, generation,
                   params.temperature, params.top_p, tool_call, getattr(serving, "reasoning_parser", None))
    if body.stream:
        return EventStreamResponse(_events(serving, reply), media_type="text/event-stream", headers=SSE_HEADERS)
    await serving._wait_finished(reply, request)  # the chat path's wait: disconnects, timeouts, core errors
    status = _status(reply.sequence.finish_reason)
    return JSONResponse(reply.response(status, reply.output(status)))


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found: this server does not store responses "
                         f"(every response is store=false)", "response_id")


def register(app: FastAPI, state, error_responses: dict) -> None:
    """Adds the /v1/responses routes to the engine server's app."""

    @app.post("/v1/responses", responses=error_responses)
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(state.require_serving(), body, request)

    @app.get("/v1/responses/{response_id}", responses=error_responses)  # a route per method: one operation id each
    @app.delete("/v1/responses/{response_id}", responses=error_responses)
    async def stored_response(response_id: str):
        raise _not_stored(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=error_responses)
    async def cancel_response(response_id: str):
        raise _not_stored(response_id)

    @app.get("/v1/responses/{response_id}/input_items", responses=error_responses)
    async def input_items(response_id: str):
        raise _not_stored(response_id)
