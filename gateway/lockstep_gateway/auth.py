"""API keys: loaded from files, a mounted Secret directory or the environment; compared in constant time.

A key never reaches a log line or a metric label: callers get an opaque key id (a short hash) to
account rate limits against.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

ENV_KEYS = "LOCKSTEP_API_KEYS"


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
