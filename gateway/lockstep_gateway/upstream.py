"""The gateway's HTTP/1.1 client to the engines: asyncio protocols, httptools' parser, a keep-alive pool per engine.

Why not httpx: relaying a streamed chunk through httpx/httpcore/h11/anyio cost about 40 % of the
gateway's CPU per chunk (profiled with py-spy, docs/BENCHMARKS.md). Here a chunk costs one parser call
and one future: the body bytes httptools hands over are queued on the connection and the relay takes
everything queued at once.

Every network step has a deadline: the connect (`connect_timeout_s`), writing the request
(`write_timeout_s`, only waited on when the socket's buffer is full), and, while a reader waits for body
bytes, the idle timeout it passes to `Response.read`. That idle deadline is one timer per silence, not
per chunk: a reader that starts waiting notes the time, and the timer, when it fires, checks whether the
reader has been waiting that long (else it re-arms itself for the rest). A reader that is busy elsewhere
(a slow client) is not waiting, so an engine is never blamed for it. Past `MAX_BUFFERED_BYTES` unread,
the connection stops reading from the engine until the reader catches up. Each engine's pool notes when
the engine last sent anything (`heard_at`), which the proxy's first-byte timeout measures.

Failures are typed by what they say about the request, which is what the proxy's retry rule needs:
`ConnectFailed`, `ConnectTimeout` and `WriteFailed` (the engine cannot have the whole request: safe to
replay), `ConnectionLost` (after the request was written: it may have started it), `IdleTimeout`.
A connection returns to its engine's pool only after a complete response that allows keep-alive;
idle ones are dropped after `keepalive_expiry_s`, below the engines' own keep-alive timeout (uvicorn's
5 s), so the gateway does not reuse a connection the engine is closing.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

import httptools

MAX_BUFFERED_BYTES = 256 << 10
KEEPALIVE_EXPIRY_S = 4.0
MAX_IDLE_PER_ENGINE = 1024


class UpstreamError(Exception):
    """A failure talking to an engine."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, TLS failed)."""


class ConnectTimeout(UpstreamError):
    """The connection was not made within the connect timeout."""


class WriteFailed(UpstreamError):
    """The request could not be written whole: the engine cannot have started it."""


class ConnectionLost(UpstreamError):
    """The connection broke (or sent garbage) after the request was written."""


class IdleTimeout(UpstreamError):
    """The engine sent nothing for the reader's idle timeout."""


class _Connection(asyncio.Protocol):
    """One connection to an engine, one request at a time (HTTP/1.1 keep-alive, no pipelining)."""

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0  # when it went back to the pool
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.head_waiter: asyncio.Future | None = None
        self.waiter: asyncio.Future | None = None
        self.waiting_since = 0.0
        self.idle_timeout_s: float | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.write_waiter: asyncio.Future | None = None
        self.written = False
        self.paused_reading = False

    # ---- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.pool.heard_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(ConnectionLost(f"the engine sent an invalid response ({error})"))
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if not self.complete:  # engines frame every body (content-length or chunked): an end before it is a loss
            if not self.written:
                self._fail(WriteFailed("the connection closed before the request was written"))
            else:
                self._fail(ConnectionLost("the engine closed the connection"))
        if self.write_waiter is not None and not self.write_waiter.done():
            self.write_waiter.set_result(None)

    def pause_writing(self) -> None:
        self.write_waiter = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.write_waiter is not None and not self.write_waiter.done():
            self.write_waiter.set_result(None)
        self.write_waiter = None

    # ---- httptools callbacks ----------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status_code = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        waiter = self.head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED_BYTES and not self.paused_reading:
            self.paused_reading = True
            self.transport.pause_reading()
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        self.complete = True
        for waiter in (self.head_waiter, self.waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self.waiter = None

    # ---- failures ---------------------------------------------------------------------------------------
    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        for waiter in (self.head_waiter, self.waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        self.waiter = None

    def _check_idle(self) -> None:
        """The idle timer: fires once per silence; re-arms while the reader waits but not yet long enough."""
        self.idle_timer = None
        waiter = self.waiter
        if waiter is None or waiter.done() or self.idle_timeout_s is None:
            return
        deadline = self.waiting_since + self.idle_timeout_s
        if self.loop.time() >= deadline:
            self.waiter = None
            waiter.set_exception(IdleTimeout(f"the engine sent nothing for {self.idle_timeout_s:g}s"))
        else:
            self.idle_timer = self.loop.call_at(deadline, self._check_idle)

    # ---- used by Response ---------------------------------------------------------------------------------
    async def read(self, idle_timeout_s: float | None) -> bytes | None:
        if not self.body:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self.waiter = waiter = self.loop.create_future()
            self.waiting_since = self.loop.time()
            if idle_timeout_s is not None:
                self.idle_timeout_s = idle_timeout_s
                if self.idle_timer is None:
                    self.idle_timer = self.loop.call_at(self.waiting_since + idle_timeout_s, self._check_idle)
            else:
                self.idle_timeout_s = None
            try:
                await waiter
            finally:
                self.waiter = None
            if not self.body:
                return None  # complete
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        self.buffered = 0
        if self.paused_reading:
            self.paused_reading = False
            self.transport.resume_reading()
        return data


class Response:
    """An engine's answer: status and headers have arrived; the body is read with `read`.
    `close` returns the connection to the pool after a complete keep-alive response, else drops it."""

    __slots__ = ("_connection", "_closed", "status_code", "headers")

    def __init__(self, connection: _Connection):
        self._connection = connection
        self._closed = False
        self.status_code = connection.status_code
        self.headers = connection.headers  # names in lower case

    async def read(self, idle_timeout_s: float | None = None) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some), or None at its end.
        After `close`, a reader still waiting gets `ConnectionLost`."""
        return await self._connection.read(idle_timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        if connection.complete and connection.keep_alive and not connection.body and not connection.closed:
            connection.pool.release(connection)
        else:
            connection.closed = True
            if connection.transport is not None:
                connection.transport.abort()  # the engine sees the connection go: it aborts the request


class _Pool:
    """The idle kept-alive connections to one engine, most recently used first."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, host_header: str):
        self.host = host
        self.port = port
        self.tls = tls
        self.host_header = host_header
        self.idle: list[_Connection] = []
        self.heard_at = float("-inf")  # loop time the engine last sent bytes on any connection

    def acquire(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and not connection.transport.is_closing() \
                    and now - connection.idle_since < KEEPALIVE_EXPIRY_S:
                return connection
            connection.closed = True
            connection.transport.close()
        return None

    def release(self, connection: _Connection) -> None:
        if connection.idle_timer is not None:
            connection.idle_timer.cancel()
        connection._reset()
        connection.idle_since = time.monotonic()
        if len(self.idle) >= MAX_IDLE_PER_ENGINE:
            connection.closed = True
            connection.transport.close()
            return
        self.idle.append(connection)

    def discard(self, connection: _Connection) -> None:
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        for connection in self.idle:
            connection.closed = True
            connection.transport.close()
        self.idle.clear()


class UpstreamClient:
    """Requests to engines by base URL (`http://host:port` or `https://...`), over per-engine pools."""

    def __init__(self, connect_timeout_s: float, write_timeout_s: float, tls: ssl.SSLContext | None = None):
        self.connect_timeout_s = connect_timeout_s
        self.write_timeout_s = write_timeout_s
        self.tls = tls
        self._pools: dict[str, _Pool] = {}

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            secure = parts.scheme == "https"
            port = parts.port or (443 if secure else 80)
            tls = (self.tls or ssl.create_default_context()) if secure else None
            pool = self._pools[base_url] = _Pool(parts.hostname, port, tls, parts.netloc)
        return pool

    def heard_at(self, base_url: str) -> float:
        """When (the event loop's clock) the engine last sent anything to this client, on any request:
        an engine that answers others is working, however long one request waits in its queue."""
        return self._pool(base_url).heard_at

    async def _connect(self, pool: _Pool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(pool, loop), pool.host, pool.port, ssl=pool.tls,
                    server_hostname=pool.host if pool.tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection within {self.connect_timeout_s:g}s") from None
        except (OSError, ssl.SSLError) as error:
            raise ConnectFailed(str(error) or type(error).__name__) from None
        return connection

    async def post(self, base_url: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        """Sends the request and waits for the response's status and headers (no deadline here: the caller
        bounds the wait for the first byte)."""
        pool = self._pool(base_url)
        connection = pool.acquire() or await self._connect(pool)
        head = [f"POST {path} HTTP/1.1\r\nhost: {pool.host_header}\r\ncontent-length: {len(body)}\r\n"]
        head.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        head.append("\r\n")
        connection.head_waiter = connection.loop.create_future()
        try:
            connection.transport.write("".join(head).encode("latin-1") + body)
            if connection.write_waiter is not None:  # the socket's buffer is full: a large body
                try:
                    async with asyncio.timeout(self.write_timeout_s):
                        await asyncio.shield(connection.write_waiter)
                except TimeoutError:
                    raise WriteFailed(f"the request was not written within {self.write_timeout_s:g}s") from None
            if connection.error is not None:
                raise connection.error
            connection.written = True
            await connection.head_waiter
        except BaseException:
            connection.closed = True
            connection.transport.abort()
            raise
        finally:
            connection.head_waiter = None
        return Response(connection)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
