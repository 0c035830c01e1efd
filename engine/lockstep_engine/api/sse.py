"""Small pieces of the OpenAI handlers: SSE framing, usage counts, chat message text, client disconnects."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import StreamingResponse

from lockstep_engine.api.client import Generation
from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.openai_models import ChatMessage


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# One encoder for every event: json.dumps builds a new encoder per call unless every option is its default.
compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict) -> str:
    return f"data: {compact_json(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response whose client disconnect cancels the stream, as Starlette's does, without
    an anyio task group per response: one watcher task waits for `http.disconnect` and cancels the task
    that streams. A cancel it did not make (the server's) still propagates."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        streaming = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone or streaming.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
        if self.background is not None:
            await self.background()


class ClientGone(Exception):
    """The HTTP client disconnected before its non-streaming response was ready."""


async def watch_disconnect(request: Request, generation: Generation) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not generation.finished and generation.error is None:
                generation.error = ClientGone()
                generation.updated.set()
            return


def message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                              f"messages.{index}.content")
        parts.append(part.text)
    return "".join(parts)


def usage(generation: Generation) -> dict:
    prompt_tokens = sum(len(state.prompt_token_ids) for state in generation.states)
    completion_tokens = sum(len(seq.token_ids) for state in generation.states for seq in state.sequences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def take_delta(job, key, seq):
    """New text/tokens of one sample of a job since the last chunk; (None, ..) when there is nothing to send."""
    new_tokens = len(seq.token_ids) - seq.sent_tokens
    releasable = seq.releasable_text()
    delta = releasable[seq.sent_text_len:]
    finishing = seq.finished and key not in job.sent_finish
    if new_tokens <= 0 and not delta and not finishing:
        return None, [], False
    new_logprobs = seq.logprobs[seq.sent_tokens:] if job.num_logprobs is not None else []
    seq.sent_tokens = len(seq.token_ids)
    seq.sent_text_len = len(releasable)
    if finishing:
        job.sent_finish.add(key)
    return delta, new_logprobs, finishing
