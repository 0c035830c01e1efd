"""`PipeSender` over real pipes and socket pairs: what `Connection.recv` reads on the other side, a reader
that stops reading, a reader that is gone, and a socket whose reader thread shares the descriptor."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
from polling import wait_until

from lockstep_engine.pipe_sender import PipeSender

DUPLEX = {"pipe": False, "socket": True}


def _pair(kind: str):
    """(the reader's end, the writer's end)."""
    return multiprocessing.Pipe(duplex=DUPLEX[kind])


def _sender(conn, errors: list) -> PipeSender:
    return PipeSender(conn, errors.append)


@pytest.mark.parametrize("kind", DUPLEX)
def test_messages_arrive_in_order_as_connection_recv_reads_them(kind):
    reader, writer = _pair(kind)
    errors = []
    sender = _sender(writer, errors)
    messages = [{"id": i, "tokens": list(range(i % 300))} for i in range(500)] + [b"x" * (3 << 20)]
    for message in messages:
        sender.send(message)
    assert [reader.recv() for _ in messages] == messages and not errors
    wait_until(lambda: sender.pending == 0, 10, "the sender to have written everything")


@pytest.mark.parametrize("kind", DUPLEX)
def test_a_reader_that_stops_reading_never_blocks_the_sender(kind):
    reader, writer = _pair(kind)
    errors = []
    sender = _sender(writer, errors)
    big = list(range(20000))  # about 100 kB pickled: a few fill the pipe's buffer
    done = threading.Event()

    def send_all():
        for i in range(64):
            sender.send((i, big))
        done.set()

    thread = threading.Thread(target=send_all, daemon=True)
    thread.start()
    assert done.wait(30), "send blocked on a full pipe"
    assert sender.pending > 0  # the pipe holds a few; the rest wait in the sender's thread
    assert [reader.recv()[0] for _ in range(64)] == list(range(64)) and not errors
    wait_until(lambda: sender.pending == 0, 10, "the sender's thread to drain")
    sender.send("after")  # written directly again
    assert reader.recv() == "after"


def test_a_socket_stays_blocking_for_the_thread_that_reads_it():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    errors = []
    sender = _sender(ours, errors)
    got = []
    reading = threading.Thread(target=lambda: got.append(ours.recv()), daemon=True)
    reading.start()
    for i in range(100):
        sender.send(i)
    assert [theirs.recv() for _ in range(100)] == list(range(100))
    assert os.get_blocking(ours.fileno())
    theirs.send("reply")  # the reader thread's blocking recv on the shared socket gets it
    reading.join(10)
    assert got == ["reply"] and not errors


@pytest.mark.parametrize("kind", DUPLEX)
def test_a_reader_that_is_gone_is_reported_once_and_later_messages_are_dropped(kind):
    reader, writer = _pair(kind)
    errors = []
    sender = _sender(writer, errors)
    reader.close()
    for i in range(5):
        sender.send(i)
    assert len(errors) == 1 and isinstance(errors[0], OSError)


def test_close_writes_what_the_thread_holds_then_drops_later_messages():
    reader, writer = _pair("pipe")
    errors = []
    sender = _sender(writer, errors)
    big = list(range(20000))
    for i in range(16):
        sender.send((i, big))
    sender.close()
    sender.send((99, big))
    assert [reader.recv()[0] for _ in range(16)] == list(range(16))
    wait_until(lambda: sender.pending == 0, 10, "the sender's thread to drain")
    writer.close()
    with pytest.raises(EOFError):
        reader.recv()
    assert not errors
