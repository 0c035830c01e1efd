"""API keys: loaded from files, a mounted Secret directory or the environment; compared in constant time;
refused in a URL's query string (`QueryKeyGuard`), on every route.

A key never reaches a log line or a metric label: callers get an opaque key id (a short hash) to
account rate limits against.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from lockstep_gateway.errors import GatewayError, error_response

ENV_KEYS = "LOCKSTEP_API_KEYS"
# Query parameters that carry a key in some clients: refused, since URLs end up in logs and proxies.
QUERY_KEY_NAMES = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token"})


def read_key_file(path: str) -> list[str]:
    """One key per line (blank lines and `#` comments skipped); a directory (a mounted Secret) gives
    one key per file, its whole content."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
        return [k for k in (f.read_text().strip() for f in files) if k]
    lines = (line.strip() for line in p.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def load_keys(files: Iterable[str], inline: Iterable[str] = (), environ: dict[str, str] | None = None) -> tuple[str, ...]:
    environ = os.environ if environ is None else environ
    keys: list[str] = list(inline)
    keys += [k.strip() for k in environ.get(ENV_KEYS, "").split(",") if k.strip()]
    for path in files:
        keys += read_key_file(path)
    return tuple(dict.fromkeys(keys))


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyChecker:
    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """The key id for a valid `Bearer KEY` header, else None. Every key is compared, so the time
        taken does not tell which key (or which prefix) came close."""
        if not authorization or authorization[:7].lower() != "bearer ":
            return None
        given = authorization[7:].strip().encode()
        match = False
        for key in self._keys:
            match |= hmac.compare_digest(given, key)
        return key_id(given.decode(errors="replace")) if match else None


class QueryKeyGuard:
    """401 for a key in the query string, on every route and before anything else: the URL (and the
    key in it) would land in access logs and proxies. The answer does not echo the key. A request with
    two Authorization headers gets a 400 here too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
            # Proxies disagree on which of two counts (the first, the last): neither does, as in the engine.
            return await error_response(GatewayError(400, "more than one Authorization header: send exactly one",
                                                     "authorization"))(scope, receive, send)
        if scope["type"] == "http" and scope.get("query_string"):
            names = {part.split(b"=", 1)[0].decode("latin-1").lower() for part in scope["query_string"].split(b"&")}
            found = sorted(names & QUERY_KEY_NAMES)
            if found:
                error = GatewayError(401, f"API keys in the query string ({found[0]}=...) are refused: they end up in "
                                          "logs; send 'Authorization: Bearer KEY' instead", found[0])
                return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)
