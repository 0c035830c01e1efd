"""A fast fake engine for `lockstep bench gateway`: OpenAI-shaped SSE completions at a controlled rate.

Standard library only, a raw asyncio HTTP/1.1 server, so that it costs far less CPU per chunk than the
gateway it feeds. It answers as an engine does: `GET /health`, `GET /v1/models` (one model, `bench`),
`GET /metrics` (the vLLM load gauges the gateway scrapes) and `POST /v1/completions`. A streamed
completion sends its first chunk at once and then one chunk per tick of one clock shared by every
stream (`--chunk-interval-ms`), as an engine's decode step emits one token for every running
sequence; `max_tokens` chunks in all, then `data: [DONE]`. Each chunk carries `sent_at`, the
`time.monotonic()` when it was written, so a client on the same host measures its delivery delay.
Connections are kept alive; the SSE body uses chunked transfer encoding, as uvicorn writes it.

    python -m lockstep.bench.fake_upstream --port 9100 --chunk-interval-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

MODEL = "bench"
MAX_MODEL_LEN = 4096
MAX_HEADER_BYTES = 64 << 10
_MODELS = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "lockstep", "root": MODEL,
     "max_model_len": MAX_MODEL_LEN}]}).encode()
_CHUNK_HEAD = (b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"bench","choices":'
               b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}],"sent_at":')
_LAST_CHUNK_HEAD = (b'data: {"id":"cmpl-bench","object":"text_completion","created":0,"model":"bench","choices":'
                    b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":"length"}],"sent_at":')
_DONE = b"data: [DONE]\n\n"
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")


def _http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(last: bool) -> bytes:
    return (_LAST_CHUNK_HEAD if last else _CHUNK_HEAD) + b"%.6f}\n\n" % time.monotonic()


def _plain(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, content_type, len(body), body))


class Clock:
    """One tick for every open stream: each gets its next chunk, streams that reached their count end."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.streams: dict[Upstream, int] = {}  # connection -> chunks still to send
        self.running = 0  # for /metrics

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick += self.interval_s
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
            for upstream, left in list(self.streams.items()):
                if upstream.transport.is_closing():
                    del self.streams[upstream]
                    continue
                left -= 1
                if left:
                    self.streams[upstream] = left
                    upstream.transport.write(_http_chunk(_event(last=False)))
                else:
                    del self.streams[upstream]
                    upstream.transport.write(_http_chunk(_event(last=True)) + _http_chunk(_DONE) + b"0\r\n\r\n")
                    upstream.stream_ended()
            self.running = len(self.streams)


class Upstream(asyncio.Protocol):
    """One client connection: requests one after another (kept alive)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.buffer = b""
        self.streaming = False
        self.transport: asyncio.Transport

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.clock.streams.pop(self, None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._serve()

    def stream_ended(self) -> None:
        self.streaming = False
        self._serve()

    def _serve(self) -> None:
        while not self.streaming:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEADER_BYTES:
                    self.transport.close()
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            self._answer(method, path.split("?", 1)[0], body)

    def _answer(self, method: str, path: str, body: bytes) -> None:
        write = self.transport.write
        if method == "GET":
            if path == "/health":
                write(_plain(200, b"{}"))
            elif path == "/v1/models":
                write(_plain(200, _MODELS))
            elif path == "/metrics":
                write(_plain(200, (f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.clock.running}\n'
                                   f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
                                   f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n').encode(),
                             b"text/plain; version=0.0.4"))
            else:
                write(_plain(404, b'{"error":{"message":"not found","type":"NotFoundError","param":null,"code":404}}'))
            return
        try:
            request = json.loads(body)
            chunks = max(1, int(request.get("max_tokens") or 16))
        except (ValueError, TypeError, AttributeError):
            write(_plain(400, b'{"error":{"message":"bad body","type":"BadRequestError","param":null,"code":400}}'))
            return
        if not request.get("stream"):
            write(_plain(200, json.dumps({
                "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": " tok" * chunks, "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": chunks, "total_tokens": chunks + 1}}).encode()))
            return
        if chunks == 1:
            write(_SSE_HEAD + _http_chunk(_event(last=True)) + _http_chunk(_DONE) + b"0\r\n\r\n")
            return
        write(_SSE_HEAD + _http_chunk(_event(last=False)))
        self.streaming = True  # the next request on this connection waits for this stream's end
        self.clock.streams[self] = chunks - 1


async def serve(host: str, port: int, interval_s: float) -> None:
    clock = Clock(interval_s)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Upstream(clock), host, port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ticking = asyncio.create_task(clock.run())
    async with server:
        await stop.wait()
    ticking.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lockstep.bench.fake_upstream", allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-interval-ms", type=float, default=20.0,
                        help="time between two chunks of a stream (one clock for all streams)")
    args = parser.parse_args(argv)
    if args.chunk_interval_ms <= 0:
        parser.error(f"--chunk-interval-ms={args.chunk_interval_ms!r} is out of range: allowed > 0")
    asyncio.run(serve(args.host, args.port, args.chunk_interval_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
