"""`--reasoning-parser`: a reasoning model's `<think>...</think>` text, kept apart from its answer.

The names are vLLM's for this style. `deepseek_r1`: everything before `</think>` is reasoning (the
chat template usually writes `<think>` into the prompt, so the output may not repeat it), and an
output that never closes the tag is all reasoning. `qwen3`: reasoning only when the output closes
the tag (a finished output), or, streamed, when it opens with `<think>`; otherwise it is the answer
(thinking switched off). Text before a `<think>` the output writes is dropped, as vLLM drops it.

A finished output is split by `split`; a stream by `ReasoningStream`, which holds back the end of the
text while it could still be the start of a tag, so what it sent is never taken back.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that is a tag's beginning (held back while streaming)."""
    longest = 0
    for tag in (START, END):
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output, None where there is none (vLLM's rules)."""
    body = text.partition(START)[2] if START in text else text
    if END not in body:
        return (body or None, None) if parser == "deepseek_r1" else (None, body)
    reasoning, _, content = body.partition(END)
    return reasoning or None, content or None


def stream_parts(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of the text so far of a streamed output; each only grows as text comes."""
    if not final:
        text = text[:len(text) - _partial_tag(text)]
    if parser == "deepseek_r1":
        body = text.partition(START)[2] if START in text else text
        reasoning, _, content = body.partition(END)
        return reasoning, content
    stripped = text.lstrip()
    if stripped.startswith(START):
        reasoning, _, content = stripped[len(START):].partition(END)
        return reasoning, content
    return "", text


class ReasoningStream:
    """Per streamed sample: what was sent of its reasoning and of its content."""

    def __init__(self, parser: str):
        self.parser = parser
        self._sent: dict[int, tuple[int, int]] = {}

    def feed(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """The new (reasoning, content) of sample `index`, given all its text so far."""
        reasoning, content = stream_parts(self.parser, text, final)
        sent_reasoning, sent_content = self._sent.get(index, (0, 0))
        self._sent[index] = (max(len(reasoning), sent_reasoning), max(len(content), sent_content))
        return reasoning[sent_reasoning:], content[sent_content:]


def _with_reasoning(message: dict, reasoning: str | None) -> dict:
    # vLLM's field, `reasoning`, and its earlier name (DeepSeek's API), `reasoning_content`
    return {**message, "reasoning": reasoning, "reasoning_content": reasoning}


def chat_message(parser: str | None, tool_call, text: str, finish_reason, message_of) -> tuple[dict, str | None]:
    """A finished chat choice's message: `message_of` (tools.message) over the content, with the reasoning."""
    if parser is None:
        return message_of(tool_call, text, finish_reason)
    reasoning, content = split(parser, text)
    message, finish_reason = message_of(tool_call, content or "", finish_reason)
    if tool_call is None:
        message["content"] = content
    return _with_reasoning(message, reasoning), finish_reason


def chat_delta(stream: ReasoningStream | None, tool_call, index: int, text: str, delta: str, finishing: bool,
               finish_reason, delta_of) -> tuple[dict | None, str | None]:
    """A streamed chat chunk's delta: `delta_of` (tools.stream_delta) over the new content, with the new
    reasoning (`text`: the sample's releasable text so far)."""
    if stream is None:
        return delta_of(tool_call, index, delta, finishing, finish_reason)
    reasoning, content = stream.feed(index, text, finishing)
    message, finish_reason = delta_of(tool_call, index, content, finishing, finish_reason)
    if not reasoning:
        return message, finish_reason
    message = dict(message or {})
    if message.get("content") == "":
        del message["content"]
    return {**message, "reasoning": reasoning, "reasoning_content": reasoning}, finish_reason
