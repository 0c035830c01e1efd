"""The OpenAI error shape, `{"error": {"message", "type", "param", "code"}}` with `code` = the HTTP status, and the
404 words for a route no server here serves: the same from the engine and the gateway.

`type` follows vLLM's names (the class names of the `openai` SDK's exceptions), so clients that branch on it
behave as they do against vLLM.
"""

from __future__ import annotations

from http import HTTPStatus

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
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


# OpenAI API routes this server does not implement: a client calling one hears so, not a mistyped URL's 404.
OPENAI_ROUTES_NOT_SERVED = (
    "/v1/embeddings", "/v1/audio", "/v1/images", "/v1/moderations", "/v1/files", "/v1/uploads", "/v1/batches",
    "/v1/fine_tuning", "/v1/vector_stores", "/v1/assistants", "/v1/threads", "/v1/realtime", "/v1/conversations",
    "/v1/evals", "/v1/containers", "/v1/videos", "/v1/score", "/v1/rerank", "/pooling", "/classify", "/score",
    "/rerank",
)
SERVED_SUMMARY = ("this server serves text generation (/v1/completions, /v1/chat/completions, /v1/responses), /v1/models, "
                  "/tokenize and /detokenize")


def route_not_found(method: str, path: str) -> str:
    """The 404 message for a path no route matches."""
    if any(path == route or path.startswith(route + "/") for route in OPENAI_ROUTES_NOT_SERVED):
        return f"{method} {path}: this OpenAI API route is not implemented here; {SERVED_SUMMARY}"
    return f"Invalid URL ({method} {path}): {SERVED_SUMMARY}"
