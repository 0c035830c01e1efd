"""Which field of an OpenAI-style request caps its output tokens, for the engine that honours it and the gateway that
budgets for it (rate limits count a request's tokens before an engine sees it).

Chat Completions has two: `max_completion_tokens`, and `max_tokens`, which OpenAI deprecated in its favour (so the
newer one wins when both are set); the Responses API names it `max_output_tokens`; Completions has `max_tokens` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Earlier fields win.
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def requested_max_tokens(request: Any) -> Any:
    """The first field of `MAX_TOKENS_FIELDS` that `request` sets (None counts as unset), as given (not validated);
    None when it sets none. `request` is a JSON object (a dict) or a parsed request with these fields as attributes."""
    get = request.get if isinstance(request, Mapping) else lambda name: getattr(request, name, None)
    for name in MAX_TOKENS_FIELDS:
        value = get(name)
        if value is not None:
            return value
    return None
