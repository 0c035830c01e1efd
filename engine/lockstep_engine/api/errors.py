"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, `code` = the HTTP status.

`type` follows vLLM's names (the class names of the `openai` SDK's exceptions), so clients that
branch on it behave as they do against vLLM.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# On a 503 the engine sends before it accepted the request (busy, loading, draining, no core): the
# gateway may replay such a request on another engine, and only such a one (gateway/lockstep_gateway/proxy.py).
RETRYABLE = {"X-Lockstep-Retryable": "1"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def refused_unstarted(message: str, retry_after: bool = False) -> APIError:
    """A 503 for a request the engine did not accept: safe to try on another engine."""
    return APIError(503, message, headers={**RETRYABLE, **({"Retry-After": "1"} if retry_after else {})})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
