"""Refusing a large request body on its sizes alone, in a worker process, before the server parses it.

Parsing JSON holds the GIL from start to end: a completion whose prompt is 2,000,000 token ids (a 16 MB
body) took 0.7-1.0 s of `json.loads` and pydantic on the engine's event loop (1.0 s in the gateway's),
during which no stream of that server moved, only to be refused for its length. The engine and the
gateway hand a body of `LARGE_BODY_BYTES` or more to a `LargeBodyReader` first: its worker process
(worker_process.py) parses it and answers with the 400 the request would get where its sizes decide it:

* a token-id prompt of `max_model_len` ids or more (in the engine's words, `validation.validate_prompt`),
  more prompts than `max_prompts`;
* any list or object anywhere in the body with more items than any field takes (`max_items`).

A body it lets through is parsed by the server as usual: what remains is a body whose sizes are
legitimate (a prompt that fits, 100,000 choices) or a large text, whose length in tokens only its
tokenizer knows (the engine tokenizes large texts in a worker of its own).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lockstep_common.worker_process import WorkerProcess

LARGE_BODY_BYTES = 1 << 20  # json.loads and pydantic take 10-20 ms a MiB of token ids on a quiet core
READ_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class BodyLimits:
    max_model_len: int | None  # None: not known (the gateway before an engine reported it)
    max_prompts: int
    max_items: int


def refusal(argument: tuple[bytes, BodyLimits]) -> tuple[str, str | None] | None:
    """In the worker: (message, param) of the 400 that the body's sizes decide, else None (also for a body
    that is not a JSON object: the server's own parse says what is wrong with it)."""
    body, limits = argument
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    return _prompt_refusal(payload.get("prompt"), limits) or _oversized(payload, limits.max_items)


def _prompt_refusal(prompt, limits: BodyLimits) -> tuple[str, str] | None:
    if not isinstance(prompt, list):
        return None
    if prompt and all(isinstance(item, int) for item in prompt):
        prompts = [prompt]
    elif len(prompt) > limits.max_prompts:
        return f"prompt: at most {limits.max_prompts} prompts per request, got {len(prompt)}", "prompt"
    else:
        prompts = [item for item in prompt if isinstance(item, list)]
    limit = limits.max_model_len
    for ids in prompts:
        if limit is not None and len(ids) >= limit:
            shown = f"<{len(ids)} tokens>"
            return (f"prompt={shown!r} is invalid: expected fewer than max_model_len={limit} tokens (leaving room "
                    f"for one output token)"), "prompt"
    return None


def _oversized(payload: dict, limit: int) -> tuple[str, str] | None:
    """The first list or object (by its path) with more items than any field of a request takes."""
    stack = [(value, key) for key, value in payload.items() if isinstance(value, (list, dict))]
    while stack:
        value, path = stack.pop()
        if len(value) > limit:
            kind = "list" if isinstance(value, list) else "object"
            path = path[:200]  # a key is the client's text: quoted, not without bound
            return f"{path}: a {kind} of {len(value)} items; no field of this server takes more than {limit}", path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((child, f"{path}.{key}") for key, child in items if isinstance(child, (list, dict)))
    return None


class LargeBodyReader:
    """One lazily started worker; `refusal` runs it from a thread, never from the event loop."""

    def __init__(self):
        self._worker = WorkerProcess("large-body reader", refusal)

    def refusal(self, body: bytes, limits: BodyLimits) -> tuple[str, str | None] | None:
        return self._worker.call((body, limits), READ_TIMEOUT_S)

    def shutdown(self) -> None:
        self._worker.close()
