"""Session affinity: requests of one session (the `--session-header`, else the OpenAI `user` field) go to
one engine, their place on a consistent-hash ring of every engine known (`Ask.offered`), so only the
sessions of an engine that leaves or joins move. The session's engine is the first candidate on the ring
in the key's order: when a filter removed its engine (down, saturated, already tried), the session goes
to the next one on the ring, the same for every request of the session."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Ask, Candidate, Incoming, Settings
from lockstep_gateway.routing.scorers import Scorer

VIRTUAL_NODES = 160
# Rings kept for member sets seen lately (a set changes when an engine is discovered or removed).
MAX_RINGS = 64


class SessionAffinity(Scorer):
    """1 for the session's engine, 0 for the others; nothing for a request with no session key."""

    name = "session-affinity"

    def __init__(self, header: str):
        self.header = header
        self._rings: dict[tuple[str, ...], HashRing] = {}

    def read(self, request: Incoming) -> str | None:
        return session_key(request.headers, request.payload, self.header)

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        key = ask.hints.get(self.name)
        if key is None:
            return [0.0] * len(candidates)
        # A ring of more members orders the candidates as a ring of the candidates alone would (the others
        # are skipped in the same walk): one ring of every engine known serves whatever the filters left.
        wanted = {c.url for c in candidates}
        ring = self._ring(tuple(sorted(wanted.union(ask.offered))))
        sticky = next(url for url in ring.preference(key) if url in wanted)
        return [1.0 if c.url == sticky else 0.0 for c in candidates]

    def _ring(self, members: tuple[str, ...]) -> HashRing:
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) >= MAX_RINGS:
                self._rings.clear()
            ring = self._rings[members] = HashRing(members)
        return ring


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes; `preference(key)` lists every member, nearest first."""

    def __init__(self, members: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((_hash(f"{member}#{i}"), member) for member in set(members) for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._members = [m for _, m in points]
        self.size = len(set(members))

    def preference(self, key: str) -> list[str]:
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, _hash(key))
        order: list[str] = []
        for i in range(len(self._members)):
            member = self._members[(start + i) % len(self._members)]
            if member not in order:
                order.append(member)
                if len(order) == self.size:
                    break
        return order


def session_key(headers: dict[str, str], body: dict, header_name: str) -> str | None:
    """The affinity key: the session header if present, else the OpenAI `user` field."""
    value = headers.get(header_name.lower())
    if value:
        return "h:" + value
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user
    return None
