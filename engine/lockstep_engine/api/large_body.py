"""Large request bodies read first in a worker process, which refuses those whose size alone is wrong.

Parsing JSON holds the GIL from start to end: a completion whose prompt is 2,000,000 token ids (a
16 MB body) took 0.7-1.0 s of `json.loads` and pydantic on the event loop, during which no stream of
the engine got a token, only to be refused for its length. A body of `LARGE_BODY_BYTES` or more is
therefore parsed in a worker process (lockstep_common/worker_process.py) first, which answers with the
400 the request would get when its size decides it:

* a token-id prompt of `max_model_len` ids or more (the message `validation.validate_prompt` gives),
  more prompts than `MAX_PROMPTS`;
* any list or object anywhere in the body with more items than any field takes: `max_model_len`
  token ids, `MAX_GUIDED_CHOICES` choices (whichever is more).

A body the worker lets through is parsed again by the app as usual: what remains is a body whose
size is legitimate (a prompt that fits, 100,000 choices), and the text of a large text prompt,
which is tokenized in a worker of its own (large_text.py).
"""

from __future__ import annotations

import json

from lockstep_common.worker_process import WorkerProcess
from lockstep_engine.guided_schema import MAX_GUIDED_CHOICES
from lockstep_engine.sampling_params import SamplingParamsError
from lockstep_engine.validation import MAX_PROMPTS

LARGE_BODY_BYTES = 1 << 20  # json.loads and pydantic take 10-20 ms a MiB of token ids on a quiet core
READ_TIMEOUT_S = 120.0


def refusal(argument: tuple[bytes, int]) -> tuple[str, str | None] | None:
    """In the worker: (message, param) of the 400 that the body's sizes decide, else None (also for a
    body that is not JSON: the app's own parse says what is wrong with it)."""
    body, max_model_len = argument
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    return _prompt_refusal(payload.get("prompt"), max_model_len) or _oversized(payload, max_model_len)


def _prompt_refusal(prompt, max_model_len: int) -> tuple[str, str] | None:
    if not isinstance(prompt, list):
        return None
    if prompt and all(isinstance(item, int) for item in prompt):
        prompts = [prompt]
    elif len(prompt) > MAX_PROMPTS:
        return f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt"
    else:
        prompts = [item for item in prompt if isinstance(item, list)]
    for ids in prompts:
        if len(ids) >= max_model_len:
            error = SamplingParamsError("prompt", f"<{len(ids)} tokens>", f"fewer than max_model_len={max_model_len} "
                                                                          f"tokens (leaving room for one output token)")
            return str(error), "prompt"
    return None


def _oversized(payload: dict, max_model_len: int) -> tuple[str, str] | None:
    """The first list or object (by its path) with more items than any field of a request takes."""
    limit = max(max_model_len, MAX_GUIDED_CHOICES)
    stack = [(value, key) for key, value in payload.items()]
    while stack:
        value, path = stack.pop()
        if not isinstance(value, (list, dict)):
            continue
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

    def refusal(self, body: bytes, max_model_len: int) -> tuple[str, str | None] | None:
        return self._worker.call((body, max_model_len), READ_TIMEOUT_S)

    def shutdown(self) -> None:
        self._worker.close()
