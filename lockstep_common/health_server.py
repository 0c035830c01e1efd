"""A uvicorn server with the health listener process (`health_listener.py`) in front of its event loop.

`HealthListenerMixin` goes before `uvicorn.Server` in a server class's bases (`lockstep serve`'s, `lockstep
gateway`'s); it imports no uvicorn itself, so that this package stays standard library only. Its `startup`
binds the listening sockets as uvicorn would (or takes `prebound`, a gateway worker's SO_REUSEPORT socket),
hands them to the listener process, and serves on its event loop the connections the listener passes over
the channel: uvicorn's own protocol, so every route, keep-alive, the header/body timeouts, auth and the
access log behave as with uvicorn's listener.

How the owner publishes its state: a subclass's `probe_answer()` gives /health's (status, raw headers, body)
and must only read state, since a thread calls it every `PUBLISH_INTERVAL_S` (off the event loop, which may be
busy for seconds). The thread sends it to the listener when it changed, and each round a tick with the time
the event loop last ran (uvicorn's `on_tick`, every 0.1 s), so the listener never waits for the loop but
knows a frozen process or a hung loop from a busy one. `probe_paths` are the paths answered with it,
`probe_request_ids` whether the answer carries an x-request-id (the engine's app adds one), and
`listener_log_format` the listener's log line format.

The protocol class (`config.http_protocol_class`) may say its `header_timeout_s`; a
connection passed on with its headers incomplete gets `header_deadline` (time.monotonic()) set before
`connection_made`, so that its header timeout runs from when the listener accepted it.

With TLS, a Unix socket, a listening fd or sockets given to uvicorn, or without epoll (not Linux), uvicorn's
own listener serves everything, `/health` included, on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import subprocess
import sys
import threading
import time

from lockstep_common.health_listener import (
    DEADLINE,
    FDS_PER_MESSAGE,
    PROBE_PATHS,
    TICK,
    UVICORN_LOG_FORMAT,
    encode_state,
)
from lockstep_common.sockets import bind_sockets

PUBLISH_INTERVAL_S = 0.05
LISTENER_EXIT_TIMEOUT_S = 5.0
STARTUP_FAILURE = 3  # uvicorn's exit code when it cannot start
logger = logging.getLogger("uvicorn.error")


class HealthListenerMixin:
    """For a `uvicorn.Server` subclass. `exit_code` is 1 when the listener process died."""

    probe_paths = PROBE_PATHS
    probe_request_ids = False
    listener_log_format = UVICORN_LOG_FORMAT
    prebound: list[socket.socket] | None = None
    exit_code = 0
    health_listener: ListenerProcess | None = None
    loop_ran_at = 0.0

    async def on_tick(self, counter: int) -> bool:
        self.loop_ran_at = time.monotonic()  # read by the publisher thread
        return await super().on_tick(counter)

    def probe_answer(self) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        return None  # no answer: uvicorn's own listener

    async def startup(self, sockets=None) -> None:
        config = self.config
        if (sockets is not None or self.probe_answer() is None or config.ssl is not None or config.uds
                or config.fd is not None or not hasattr(select, "epoll")):
            return await super().startup(sockets if sockets is not None else self.prebound)
        # As uvicorn.server.Server.startup for host:port, with the listener process in place of create_server.
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        try:
            listeners = self.prebound or bind_sockets(config.host, config.port, config.backlog)
        except OSError as error:
            logger.error(error)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        self._log_started_message(listeners)
        self.health_listener = ListenerProcess(self, listeners, asyncio.get_running_loop())
        self.servers = [self.health_listener]
        self.started = True

    def listener_lost(self, reason: str) -> None:
        """No listener means no server: exit non-zero, so that the supervisor restarts it."""
        logger.error("the health listener process %s; shutting down", reason)
        self.exit_code = 1
        self.should_exit = True


class ListenerProcess:
    """The server's side of the listener: starts it, publishes /health's answer, serves the connections it
    passes. `close` and `wait_closed` are what uvicorn's shutdown calls on its servers."""

    def __init__(self, server: HealthListenerMixin, listeners: list[socket.socket], loop: asyncio.AbstractEventLoop):
        config = server.config
        protocol = config.http_protocol_class
        self._server = server
        self._loop = loop
        self._adopting: set[asyncio.Task] = set()
        self.closed = False
        self._channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._published = b""
        self._publish()  # the first answer waits in the channel; the listener accepts once it has it
        access_log = config.access_log and logging.getLogger("uvicorn.access").hasHandlers()
        command = [sys.executable, "-m", "lockstep_common.health_listener", f"--channel-fd={theirs.fileno()}",
                   f"--header-timeout={getattr(protocol, 'header_timeout_s', 10.0)}",
                   f"--keep-alive-timeout={config.timeout_keep_alive}",
                   f"--log-level={logger.getEffectiveLevel()}", f"--log-format={server.listener_log_format}",
                   *(["--access-log"] if access_log else []), *(["--request-ids"] if server.probe_request_ids else []),
                   *(f"--path={path.decode()}" for path in server.probe_paths),
                   *(f"--listen-fd={sock.fileno()}" for sock in listeners)]
        try:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                             pass_fds=[theirs.fileno(), *(sock.fileno() for sock in listeners)])
        finally:
            theirs.close()
            for sock in listeners:
                sock.close()  # the listener's now: the port closes when it exits
        self._channel.setblocking(False)
        loop.add_reader(self._channel.fileno(), self._receive)
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="health-publisher", daemon=True)
        self._publisher.start()

    # ---- /health's answer, off the loop -----------------------------------------------------------------
    def _publish_loop(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            self._publish()

    def _publish(self) -> None:
        config = self._server.config
        message = encode_state(*self._server.probe_answer(), config.encoded_headers, config.date_header)
        try:
            if message != self._published:
                self._channel.send(message)
                self._published = message
            # before main_loop's first tick, startup has just run on the loop
            self._channel.send(TICK.pack(self._server.loop_ran_at or time.monotonic()))
        except OSError:  # full (the listener is behind) or closed: the next round tries again
            return

    # ---- connections from the listener, on the loop ---------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._channel, DEADLINE.size * FDS_PER_MESSAGE, FDS_PER_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                data, fds, reason = b"", [], f"broke its channel ({error})"
            else:
                reason = "closed its channel"
            if not data and not fds:
                self._loop.remove_reader(self._channel.fileno())
                if not self.closed:
                    self._server.listener_lost(reason)
                return
            for i, fd in enumerate(fds):
                sock = socket.socket(fileno=fd)
                if self.closed:  # uvicorn's shutdown began: no new connections, as with its own listener
                    sock.close()
                    continue
                deadline = DEADLINE.unpack_from(data, i * DEADLINE.size)[0] or None
                task = self._loop.create_task(self._adopt(sock, deadline))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, sock: socket.socket, header_deadline: float | None) -> None:
        server, config = self._server, self._server.config

        def protocol():
            made = config.http_protocol_class(config=config, server_state=server.server_state,
                                              app_state=server.lifespan.state, _loop=self._loop)
            made.header_deadline = header_deadline  # headers incomplete: the timeout started in the listener
            return made

        try:
            await self._loop.connect_accepted_socket(protocol, sock)
        except OSError:
            sock.close()  # the client went away before the loop took the connection

    # ---- what uvicorn's shutdown calls ---------------------------------------------------------------------
    def close(self) -> None:
        """Closes the channel: the listener closes the listening sockets and its connections, and exits."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._publisher.join()
        self._loop.remove_reader(self._channel.fileno())
        self._channel.close()

    async def wait_closed(self) -> None:
        deadline = time.monotonic() + LISTENER_EXIT_TIMEOUT_S
        while self._process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
