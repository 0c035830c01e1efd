"""`PipeReader`: messages from a `multiprocessing.Connection`'s pipe or socket, read on an asyncio loop.

The other side writes with `Connection.send` (or `PipeSender`): a 4-byte big-endian length (or -1 and an
8-byte length for a message over 2 GiB), then the pickled bytes. The loop is told when the descriptor is
readable (`add_reader`), reads what is there without blocking and hands each whole message to
`on_message`. No thread reads the pipe: a reader thread in a process whose event loop writes sockets all
the time holds the GIL in turns with it, and every write the loop makes (a chunk to a client, a request to
the core) then waits for the reader's unpickling to finish. This is the API server reading the engine
core's outputs.

A read takes at most `READ_BUDGET` bytes before the loop gets its turn again (its other callbacks run, and
it comes back while the pipe still holds data); a message larger than that is put together over several
turns. The descriptor's blocking mode is left alone for a socket (another thread may write it with
MSG_DONTWAIT); a pipe's read end is made non-blocking (nothing else reads it).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
import time
import traceback
from typing import Callable

from lockstep_engine.log import log
from lockstep_engine.pipe_sender import unblocked_descriptor

READ_SIZE = 256 * 1024  # bytes asked for per read
READ_BUDGET = 1024 * 1024  # bytes read in one turn of the loop
_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


class PipeReader:
    def __init__(self, conn, loop: asyncio.AbstractEventLoop, on_message: Callable[[object, float], None],
                 on_closed: Callable[[str], None]):
        """`conn`: a `multiprocessing.Connection` (its descriptor; the object stays the caller's to close).
        `on_message(message, received_at)`: each message, `received_at` the `time.monotonic()` of its read.
        `on_closed(reason)`: called once when the other side is gone (end of file or a read error)."""
        self._conn = conn  # held: a Connection closes its descriptor when it is collected
        self._socket, self._fd = unblocked_descriptor(conn)
        self._loop = loop
        self._on_message = on_message
        self._on_closed = on_closed
        self._buffer = bytearray()
        self._start = 0  # where the first unread message begins in `_buffer`
        self._closed = False
        loop.add_reader(self._fd, self.read_available)

    def read_available(self) -> None:
        """Reads what the pipe holds now (up to `READ_BUDGET` bytes) and hands over each whole message."""
        if self._closed:
            return
        budget = READ_BUDGET
        while budget > 0:
            try:
                data = self._read()
            except BlockingIOError:
                break
            except OSError as error:
                self._close(f"a read failed ({error})")
                return
            if not data:
                self._deliver(time.monotonic())
                self._close("end of file")
                return
            self._buffer += data
            budget -= len(data)
            if len(data) < READ_SIZE:
                break
        self._deliver(time.monotonic())

    def close(self) -> None:
        """Stops reading (without calling `on_closed`); the connection stays the caller's to close."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
            if self._socket is not None:
                self._socket.close()

    # ---- inside -----------------------------------------------------------------------------
    def _read(self) -> bytes:
        if self._socket is not None:
            return self._socket.recv(READ_SIZE, socket.MSG_DONTWAIT)
        return os.read(self._fd, READ_SIZE)

    def _deliver(self, received_at: float) -> None:
        buffer, start = self._buffer, self._start
        view = memoryview(buffer)
        try:
            while len(buffer) - start >= _LENGTH.size:
                size, header = _LENGTH.unpack_from(buffer, start)[0], _LENGTH.size
                if size == -1:
                    if len(buffer) - start < _LENGTH.size + _LONG_LENGTH.size:
                        break
                    size, header = _LONG_LENGTH.unpack_from(buffer, start + _LENGTH.size)[0], \
                        _LENGTH.size + _LONG_LENGTH.size
                if len(buffer) - start < header + size:
                    break
                message = pickle.loads(view[start + header:start + header + size])
                start += header + size
                try:
                    self._on_message(message, received_at)
                except Exception:  # one message's handling must not stop the others
                    log(f"error: handling {type(message).__name__} failed:\n{traceback.format_exc()}")
        finally:
            view.release()
        if start:
            del buffer[:start]  # one move per turn, not one per message
        self._start = 0

    def _close(self, reason: str) -> None:
        if not self._closed:
            self.close()
            self._on_closed(reason)
