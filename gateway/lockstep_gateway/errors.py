"""The gateway's errors: `GatewayError` and its OpenAI-shaped responses and stream-ending events (the shape is
`lockstep_common.errors`, as the engine server writes it)."""

from __future__ import annotations

import json

from lockstep_common.anthropic_errors import anthropic_error_body
from lockstep_common.errors import error_body
from starlette.responses import JSONResponse


class GatewayError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after


def error_response(error: GatewayError, request_id: str | None = None) -> JSONResponse:
    """A server-side failure names the request id, which the gateway's log line carries too."""
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}
    if error.status == 408:  # the rest of a slow body may still trickle in: the connection is not reused
        headers["Connection"] = "close"
    message = error.message
    if request_id:
        headers["x-request-id"] = request_id
        if error.status >= 500:
            message = f"{message} (request id {request_id})"
    return JSONResponse(error_body(error.status, message, error.param), status_code=error.status, headers=headers)


def sse_error_event(status: int, message: str, route: str | None = None) -> bytes:
    """The event that ends a stream the gateway cannot finish, then `[DONE]` as the engine does (on
    /v1/messages: Anthropic's `error` event, which ends a stream there)."""
    if route == "messages":
        return b"event: error\ndata: " + json.dumps(anthropic_error_body(status, message)).encode() + b"\n\n"
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"
