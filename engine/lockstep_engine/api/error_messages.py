"""The words of FastAPI's and Starlette's own errors (routing's 404 and 405, request validation), in the OpenAI
error shape's message and param."""

from __future__ import annotations

from fastapi import Request

from lockstep_engine.api.errors import route_not_found


def http_error_message(request: Request, status: int, detail: str, headers: dict | None) -> str:
    """Routing's own 404 and 405 in words a client can act on."""
    if status == 404 and detail == "Not Found":
        return route_not_found(request.method, request.url.path)
    if status == 405 and headers and "Allow" in headers:
        return f"{request.method} is not allowed on {request.url.path}: allowed {headers['Allow']}"
    return detail


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    lines, param = [], None
    if errors and errors[0].get("type") == "json_invalid":  # loc holds a byte offset, not a field
        offset = errors[0].get("loc", (None, None))[-1]
        reason = (errors[0].get("ctx") or {}).get("error") or errors[0].get("msg", "invalid")
        return f"the request body is not valid JSON: {reason} (at byte {offset})", None
    for error in errors[:10]:
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        where = ".".join(loc) or "body"
        param = param or (".".join(loc) if loc else None)
        lines.append(f"{where}: {error.get('msg', 'invalid')}")
    count = len(errors)
    return f"{count} validation error{'s' if count != 1 else ''}: " + "; ".join(lines), param
