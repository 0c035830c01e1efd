"""The engine's limits for lockstep_common/large_body.py, which reads a large body in a worker process
and refuses it when its sizes alone decide the answer (a token-id prompt past `max_model_len`, a list
longer than any field takes) before the app parses it on its event loop."""

from __future__ import annotations

from lockstep_common.large_body import BodyLimits
from lockstep_engine.guided_schema import MAX_GUIDED_CHOICES
from lockstep_engine.validation import MAX_PROMPTS


def body_limits(max_model_len: int) -> BodyLimits:
    """No field takes more items than a prompt's token ids or a choice list has."""
    return BodyLimits(max_model_len, MAX_PROMPTS, max(max_model_len, MAX_GUIDED_CHOICES))
