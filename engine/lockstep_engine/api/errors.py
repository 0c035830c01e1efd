"""The engine server's errors: `APIError` and its OpenAI-shaped responses (the shape and the 404 words are
`lockstep_common.errors`, shared with the gateway), and the headers that tell the gateway how to count one.
"""

from __future__ import annotations

from lockstep_common.errors import error_body, route_not_found
from starlette.responses import JSONResponse

__all__ = ["APIError", "REQUEST_FAULT", "RETRYABLE", "bad_request", "error_body", "error_response", "refused_unstarted",
           "route_not_found"]

# On a 503 the engine sends before it accepted the request (busy, loading, draining, no core): the
# gateway may replay such a request on another engine, and only such a one (gateway/lockstep_gateway/proxy.py).
RETRYABLE = {"X-Lockstep-Retryable": "1"}
# On a 500 the engine raised for one request while it stays healthy (its core failed that request alone,
# or the request hit a bug of the API process): the gateway's circuit breaker does not count it against
# the engine, so a client that keeps sending such a request cannot take the model offline.
REQUEST_FAULT = {"X-Lockstep-Request-Fault": "1"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def refused_unstarted(message: str, retry_after: bool = False) -> APIError:
    """A 503 for a request the engine did not accept: safe to try on another engine."""
    return APIError(503, message, headers={**RETRYABLE, **({"Retry-After": "1"} if retry_after else {})})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
