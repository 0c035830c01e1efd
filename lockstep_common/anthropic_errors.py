"""Anthropic's side of the Messages API routes (`/v1/messages...`), shared by the engine server and the gateway.

Clients of that API read errors as `{"type": "error", "error": {"type": "not_found_error", "message": ...}}`
and send their key as `x-api-key`. `AnthropicRoutes` wraps an ASGI app: on those paths it takes an
`x-api-key` header as `Authorization: Bearer` (when no Authorization header is sent) and rewrites every
OpenAI-shaped error answer (`{"error": {"message", "type", "param", "code"}}`), whoever raised it (auth,
body limits, validation, routing, the handler), into Anthropic's shape with the same status.
"""

from __future__ import annotations

import json

PATH_PREFIX = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _rewritten(status: int, body: bytes, request_id: str | None) -> bytes | None:
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if payload.get("type") == "error" or not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    answer = anthropic_error_body(status, error["message"])
    if request_id:
        answer["request_id"] = request_id
    return json.dumps(answer, ensure_ascii=False).encode()


class AnthropicRoutes:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        if not any(name == b"authorization" for name, _ in headers):
            keys = [value for name, value in headers if name == b"x-api-key"]
            if len(keys) == 1:
                scope = {**scope, "headers": [*headers, (b"authorization", b"Bearer " + keys[0])]}
        start: dict | None = None
        parts: list[bytes] = []

        async def rewrite(message):
            nonlocal start
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 400 and content_type.startswith(b"application/json"):
                    start = message  # held until the whole body is here
                    return
                return await send(message)
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(parts)
            response_headers = list(start.get("headers", []))
            request_id = dict(response_headers).get(b"x-request-id")
            new = _rewritten(start["status"], body, request_id.decode("latin-1") if request_id else None)
            if new is not None:
                body = new
                response_headers = [(name, str(len(body)).encode() if name == b"content-length" else value)
                                    for name, value in response_headers]
            await send({**start, "headers": response_headers})
            await send({"type": "http.response.body", "body": body})

        return await self.app(scope, receive, rewrite)
