"""`EventStreamResponse` driven by a plain ASGI receive/send pair on a real event loop: a whole stream, a
client that disconnects mid-stream (the stream is cancelled, its cleanup runs, the response ends quietly),
and a cancel from the server (it still propagates)."""

from __future__ import annotations

import asyncio

import pytest

from lockstep_engine.api.sse import EventStreamResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


class Client:
    def __init__(self):
        self.sent: list[dict] = []
        self.disconnect = asyncio.Event()

    async def receive(self) -> dict:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_a_whole_stream_is_sent_and_ends_the_body():
    async def main():
        client = Client()

        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"

        await EventStreamResponse(chunks())(SCOPE, client.receive, client.send)
        return client

    client = asyncio.run(main())
    assert client.sent[0]["type"] == "http.response.start"
    assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
    assert client.bodies() == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert client.sent[-1]["more_body"] is False


def test_a_disconnect_cancels_the_stream_and_its_cleanup_runs():
    async def main():
        client = Client()
        cleaned = asyncio.Event()

        async def chunks():
            try:
                yield "data: first\n\n"
                client.disconnect.set()
                await asyncio.Event().wait()  # waits for tokens that never come
                yield "data: never\n\n"
            finally:
                cleaned.set()  # serving's _stream aborts the request here

        async with asyncio.timeout(10):
            await EventStreamResponse(chunks())(SCOPE, client.receive, client.send)
        return client, cleaned.is_set()

    client, cleaned = asyncio.run(main())
    assert cleaned
    assert client.bodies() == [b"data: first\n\n"]  # no end of body: the client is gone


def test_a_cancel_from_the_server_is_not_swallowed():
    async def main():
        client = Client()
        started = asyncio.Event()

        async def chunks():
            started.set()
            yield "data: first\n\n"
            await asyncio.Event().wait()
            yield "data: never\n\n"

        task = asyncio.ensure_future(EventStreamResponse(chunks())(SCOPE, client.receive, client.send))
        await started.wait()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
