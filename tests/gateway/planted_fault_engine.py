"""`lockstep serve` with one bug planted, for the breaker test: a completion whose prompt is
`PLANTED_PROMPT` raises inside the API process, as a bug that one request's input reaches would. The
engine answers it 500 and stays healthy, so it marks the 500 as the request's (X-Lockstep-Request-Fault).

Run as `python tests/gateway/planted_fault_engine.py serve MODEL ...` (the arguments of `lockstep`)."""

from __future__ import annotations

import sys

from lockstep.cli import main
from lockstep_engine.api.serving import OpenAIServing

PLANTED_PROMPT = [13, 13, 13, 13]
_create_completion = OpenAIServing.create_completion


async def _planted(self, body, request):
    if body.prompt == PLANTED_PROMPT:
        raise ZeroDivisionError("the planted bug")
    return await _create_completion(self, body, request)


if __name__ == "__main__":
    OpenAIServing.create_completion = _planted
    sys.exit(main())
