"""`PipeReader` on a real asyncio loop over real pipes and socket pairs, written by `Connection.send` and
`PipeSender` from another thread: order, large messages over several turns, a frame split across writes,
the end of the pipe, a handler that fails, and a socket whose blocking mode is shared with a writer."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import struct
import threading

import pytest

from lockstep_engine import pipe_reader
from lockstep_engine.pipe_reader import PipeReader
from lockstep_engine.pipe_sender import PipeSender

DUPLEX = {"pipe": False, "socket": True}
TIMEOUT_S = 30.0


class Inbox:
    """What a reader handed over, and a way for the loop to wait for a number of messages or the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.messages: list = []
        self.closed: list[str] = []
        self.changed = asyncio.Event()

    def on_message(self, message, received_at: float) -> None:
        assert received_at > 0
        self.messages.append(message)
        self.changed.set()

    def on_closed(self, reason: str) -> None:
        self.closed.append(reason)
        self.changed.set()

    async def until(self, done) -> None:
        async with asyncio.timeout(TIMEOUT_S):
            while not done():
                self.changed.clear()
                await self.changed.wait()


def _send_in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", DUPLEX)
def test_messages_from_connection_send_arrive_whole_and_in_order(kind):
    big = b"x" * (3 * pipe_reader.READ_BUDGET + 17)  # read over several turns of the loop
    messages = [{"id": i, "tokens": list(range(i % 300))} for i in range(500)] + [big, "last"]

    async def main():
        reader_end, writer_end = multiprocessing.Pipe(duplex=DUPLEX[kind])
        inbox = Inbox(asyncio.get_running_loop())
        reader = PipeReader(reader_end, inbox.loop, inbox.on_message, inbox.on_closed)
        thread = _send_in_thread(lambda: [writer_end.send(m) for m in messages])
        await inbox.until(lambda: len(inbox.messages) == len(messages))
        thread.join(TIMEOUT_S)
        reader.close()
        return inbox

    inbox = asyncio.run(main())
    assert inbox.messages == messages and not inbox.closed


def test_a_frame_split_across_writes_is_put_together():
    async def main():
        read_fd, write_fd = os.pipe()
        reader_end = multiprocessing.connection.Connection(read_fd, writable=False)
        inbox = Inbox(asyncio.get_running_loop())
        reader = PipeReader(reader_end, inbox.loop, inbox.on_message, inbox.on_closed)
        # two frames, written a few bytes at a time, with the loop running between the writes
        frames = b"".join(struct.pack("!i", len(d)) + d for d in (pickle.dumps("one"), pickle.dumps(["two", 2])))
        for start in range(0, len(frames), 3):
            os.write(write_fd, frames[start:start + 3])
            await asyncio.sleep(0)
        await inbox.until(lambda: len(inbox.messages) == 2)
        os.close(write_fd)
        await inbox.until(lambda: inbox.closed)
        reader.close()
        return inbox

    inbox = asyncio.run(main())
    assert inbox.messages == ["one", ["two", 2]]
    assert inbox.closed == ["end of file"]


@pytest.mark.parametrize("kind", DUPLEX)
def test_the_end_of_the_pipe_comes_after_every_message_before_it_and_once(kind):
    async def main():
        reader_end, writer_end = multiprocessing.Pipe(duplex=DUPLEX[kind])
        inbox = Inbox(asyncio.get_running_loop())
        PipeReader(reader_end, inbox.loop, inbox.on_message, inbox.on_closed)
        for i in range(10):
            writer_end.send(i)
        writer_end.close()
        await inbox.until(lambda: inbox.closed)
        for _ in range(3):  # the loop goes on: no second end, no reads of a closed descriptor
            await asyncio.sleep(0)
        return inbox

    inbox = asyncio.run(main())
    assert inbox.messages == list(range(10))
    assert inbox.closed == ["end of file"]


def test_a_handler_that_fails_on_one_message_gets_the_next_ones(capsys):
    async def main():
        reader_end, writer_end = multiprocessing.Pipe(duplex=False)
        inbox = Inbox(asyncio.get_running_loop())

        def on_message(message, received_at):
            if message == "bad":
                raise RuntimeError("a bug in one message's handling")
            inbox.on_message(message, received_at)

        reader = PipeReader(reader_end, inbox.loop, on_message, inbox.on_closed)
        for message in ("a", "bad", "b"):
            writer_end.send(message)
        await inbox.until(lambda: len(inbox.messages) == 2)
        reader.close()
        return inbox

    inbox = asyncio.run(main())
    assert inbox.messages == ["a", "b"] and not inbox.closed
    assert "a bug in one message's handling" in capsys.readouterr().err


def test_close_stops_the_reads_without_calling_on_closed():
    async def main():
        reader_end, writer_end = multiprocessing.Pipe(duplex=False)
        inbox = Inbox(asyncio.get_running_loop())
        reader = PipeReader(reader_end, inbox.loop, inbox.on_message, inbox.on_closed)
        writer_end.send("before")
        await inbox.until(lambda: inbox.messages)
        reader.close()
        writer_end.send("after")
        writer_end.close()
        for _ in range(5):
            await asyncio.sleep(0.01)  # turns of the loop in which a live reader would have read both
        return inbox

    inbox = asyncio.run(main())
    assert inbox.messages == ["before"] and not inbox.closed


def test_a_socket_stays_blocking_for_a_thread_that_shares_it():
    """With several API servers, one socket carries both directions: `PipeSender` writes it from the loop,
    its overflow thread waits on it, and the reader must not make it non-blocking under them."""
    async def main():
        core_end, api_end = multiprocessing.Pipe(duplex=True)
        inbox = Inbox(asyncio.get_running_loop())
        reader = PipeReader(api_end, inbox.loop, inbox.on_message, inbox.on_closed)
        sender = PipeSender(api_end, lambda error: None)
        sender.send("request")
        assert os.get_blocking(api_end.fileno())
        assert core_end.recv() == "request"
        core_end.send("output")
        await inbox.until(lambda: inbox.messages)
        reader.close()
        sender.close()
        return inbox

    assert asyncio.run(main()).messages == ["output"]


def test_the_reader_keeps_its_connection_open_when_the_caller_drops_it():
    """A `Connection` closes its descriptor when collected: the API client hands the reader a pipe end it
    keeps no reference to."""
    async def main():
        inbox = Inbox(asyncio.get_running_loop())

        def attach():
            reader_end, writer_end = multiprocessing.Pipe(duplex=False)
            return PipeReader(reader_end, inbox.loop, inbox.on_message, inbox.on_closed), writer_end

        reader, writer_end = attach()
        gc.collect()
        writer_end.send("still open")
        await inbox.until(lambda: inbox.messages or inbox.closed)
        reader.close()
        return inbox

    inbox = asyncio.run(main())
    assert inbox.messages == ["still open"] and not inbox.closed
