"""The group channel: the leader's control messages to its workers, authenticated with the group secret.

Every rank of a group holds the same secret (`load_secret`: the file LOCKSTEP_GROUP_SECRET_FILE names,
as the operator mounts it, or LOCKSTEP_GROUP_SECRET; `lockstep serve --tensor-parallel-size N` makes
one for the workers it spawns). At the rendezvous each rank proves that it knows the secret before
the group forms (`hello_proof`, exchanged by `rendezvous.init_group` through the rendezvous store),
against a fresh nonce of the leader's, and the leader proves it to the workers in turn.

A control message is a frame: a header (magic, kind, counter), an HMAC-SHA256 tag under a key drawn
from the secret and that nonce, and the payload (a plan codec message: JSON, never pickle). A worker
checks the tag before it reads anything else, then the counter (a replayed, dropped or reordered
frame is refused), and only then hands the payload to the plan decoder. Frames travel as two gloo
broadcasts (size, bytes) on a control group of their own: CPU tensors on every backend, and a timeout
of their own, since an idle leader sends nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import struct
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from lockstep_engine.group.errors import AuthenticationError, GroupError

SECRET_FILE_ENV = "LOCKSTEP_GROUP_SECRET_FILE"
SECRET_ENV = "LOCKSTEP_GROUP_SECRET"
MIN_SECRET_CHARS = 16

WINDOW, STOP = 1, 2  # frame kinds: a plan codec message; the leader's stop
_KINDS = {WINDOW: "window", STOP: "stop"}
_MAGIC = b"LSC1"
_HEADER = struct.Struct("<4sBQ")  # magic, kind, counter
_TAG_BYTES = hashlib.sha256().digest_size
MAX_FRAME_BYTES = 1 << 30  # a size beyond this is refused before any buffer is allocated


def load_secret() -> bytes | None:
    """This rank's group secret, or None when neither variable is set."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        source = f"{SECRET_FILE_ENV}={path!r}"
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise GroupError(f"{source}: the group secret cannot be read ({error})") from error
    else:
        source, text = SECRET_ENV, os.environ.get(SECRET_ENV, "").strip()
        if not text:
            return None
    if len(text) < MIN_SECRET_CHARS:
        raise GroupError(f"{source}: the group secret has {len(text)} characters; expected at least "
                         f"{MIN_SECRET_CHARS} (the operator's holds 44 characters of base64)")
    return text.encode()


def new_secret() -> bytes:
    """A random secret for a group whose ranks this process spawns: 32 bytes as 44 base64 characters."""
    return base64.b64encode(secrets.token_bytes(32))


def _mac(key: bytes, *parts: object) -> bytes:
    return hmac.new(key, "|".join(map(str, parts)).encode(), hashlib.sha256).digest()


def hello_proof(secret: bytes, nonce: str, world: int, rank: int) -> bytes:
    """What rank `rank` sends at the rendezvous (rank 0: the leader's proof to its workers)."""
    return _mac(secret, "lockstep-hello/1", nonce, world, rank)


def verdict_proof(secret: bytes, nonce: str, world: int) -> bytes:
    """The leader's word that every rank proved the secret and the group may form."""
    return _mac(secret, "lockstep-verdict/1", nonce, world)


def channel_key(secret: bytes, nonce: str) -> bytes:
    """The key of this group's control frames: a fresh one per rendezvous, so no frame outlives its group."""
    return _mac(secret, "lockstep-channel/1", nonce)


def seal(key: bytes, kind: int, counter: int, payload: bytes) -> bytes:
    header = _HEADER.pack(_MAGIC, kind, counter)
    return header + hmac.new(key, header + payload, hashlib.sha256).digest() + payload


def unseal(key: bytes, counter: int, frame: bytes) -> tuple[int, bytes]:
    """(kind, payload) of the frame expected as number `counter`; AuthenticationError when it is not."""
    start = _HEADER.size + _TAG_BYTES
    if len(frame) < start:
        raise AuthenticationError(f"control message {counter}: {len(frame)} bytes, shorter than a frame; refused")
    header, tag, payload = frame[:_HEADER.size], frame[_HEADER.size:start], frame[start:]
    if not hmac.compare_digest(tag, hmac.new(key, header + payload, hashlib.sha256).digest()):
        raise AuthenticationError(f"control message {counter} failed authentication (HMAC-SHA256 under the group "
                                  "secret): it was altered or not sent by this group's leader; refused")
    magic, kind, number = _HEADER.unpack(header)
    if magic != _MAGIC or kind not in _KINDS:
        raise AuthenticationError(f"control message {counter}: unknown frame {magic!r} kind {kind}; refused")
    if number != counter:
        raise AuthenticationError(f"control message {number} arrived where {counter} was expected: replayed, "
                                  "dropped or reordered; refused")
    return kind, payload


class GroupChannel:
    """The leader's side sends, every other rank receives, frames in one order."""

    def __init__(self, key: bytes, world: int, timeout: timedelta):
        self._key = key
        self._counter = 0
        # Created by every rank in the same order, after the model's groups (a torch.distributed rule).
        self._group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)

    def send(self, kind: int, payload: bytes = b"") -> None:
        frame = np.frombuffer(seal(self._key, kind, self._counter, payload), np.uint8).copy()
        dist.broadcast(torch.tensor([frame.size], dtype=torch.int64), src=0, group=self._group)
        dist.broadcast(torch.from_numpy(frame), src=0, group=self._group)
        self._counter += 1

    def receive(self) -> tuple[int, bytes]:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        length = int(size[0])
        if not 0 < length <= MAX_FRAME_BYTES:
            raise AuthenticationError(f"control message {self._counter}: a frame of {length} bytes was announced "
                                      f"(at most {MAX_FRAME_BYTES}); refused")
        frame = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self._group)
        kind, payload = unseal(self._key, self._counter, frame.numpy().tobytes())
        self._counter += 1
        return kind, payload
