"""The health listener: a small process that owns a server's listening socket, answers `/health` itself and
passes every other connection to the server's process (`health_server.py` starts it; `lockstep serve` and
`lockstep gateway` run one each, and every gateway worker its own). Below, "the API process" is that server.

Why: with thousands of streams open the API process's event loop is busy for seconds at a time (h11 and
the SSE sends, admitting a burst of arrivals), and a probe's connection waited behind that work in
first-in-first-out order; the kubelet and the gateway then took a busy engine for a dead one. A thread in
the API process does not escape it either: every socket call gives up the GIL and waits up to the
switch interval (5 ms) to get it back from the busy loop, so a thread that handles every connection
falls seconds behind a burst (measured; docs/RELIABILITY.md).

How: this process accepts every connection and peeks (MSG_PEEK) at its first request at once (64 accepts
per round, so a probe behind a burst of connections is not left until the whole burst is accepted). A
complete `GET /health` or `GET /ping` (the paths it is given; `probe_http.py` says what counts as one) is
answered here with what the app would send: the status, headers and body the API process last published
over the channel (refreshed every 50 ms; `health_server.py`), the caller's or a new x-request-id when the
app sends one, uvicorn's date and server headers, and an access-log line when that log is on. The
connection stays here while it sends only such requests (keep-alive, closed after the keep-alive timeout
idle). Anything else (another route or method, a body, `Origin`, `Expect`, `Upgrade`, `X-Forwarded-For`,
a request the strict probe parser does not take, headers beyond 8 KiB) is passed untouched, since nothing
was consumed, with its header deadline while its headers are incomplete, over a Unix socket (SCM_RIGHTS,
up to 64 connections per message, once per round) to the API process, whose loop serves it with uvicorn's
protocol as if it had accepted it itself. A connection whose headers are not complete within the header
timeout is closed, as uvicorn's protocol would.

Only a live API process's answer is given. When it is stopped (SIGSTOP: its /proc state) or its event
loop has not run for `LOOP_STUCK_S` (hung, not merely busy: under a burst of 3000 streams it stalled for up
to 18 s; its thread sends a tick every 50 ms with the time the loop last ran), probes go to the API process
like any other request, and time out there as they did before. A silent publisher alone is not taken for a
dead process: in a 3000-stream run it missed its ticks for over a second (the GIL held by others), and a
probe that went to the busy loop then took 5.5 s.

Standard library only: the gateway and the engine both run it, and neither's packages are imported here.
Nothing here blocks: an edge-triggered epoll (a peeked, incomplete request wakes this process again only
when more bytes arrive), every socket call non-blocking, one send of a few hundred bytes per answer (a client
that does not take them is closed), and connections the API process is slow to take wait in a queue
here. The process ignores SIGINT/SIGTERM (the API process drains, then closes the channel) and exits
when the channel closes, also when the API process was killed.
"""

from __future__ import annotations

import argparse
import email.utils
import errno
import json
import logging
import os
import re
import select
import signal
import socket
import struct
import sys
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus

from lockstep_common.probe_http import NEED_DATA, PROBE_MAX_BYTES, Probe, ProbeParser, response

PROBE_PATHS = (b"/health", b"/ping")
UVICORN_LOG_FORMAT = "%(levelprefix)s %(message)s"
_ACCEPT_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_PAUSE_S = 1.0  # as asyncio: out of file descriptors, try accepting again after this
FDS_PER_MESSAGE = 64  # connections passed per channel message
ACCEPTS_PER_ROUND = 64
DEADLINE = struct.Struct("d")  # a passed connection's header deadline (time.monotonic(), system-wide); 0: none
TICK = struct.Struct("d")  # the API process's liveness message: when its event loop last ran (time.monotonic())
LOOP_STUCK_S = 30.0  # its event loop has not run for this long (hung): it answers probes itself, so they time out
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")

logger = logging.getLogger("lockstep.health_listener")
access_logger = logging.getLogger("lockstep.health_listener.access")


def request_id(headers) -> str:
    """The caller's X-Request-Id when it is a sane token (a gateway's id carries through), else a new one."""
    for name, value in headers:
        if name == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return value.decode()
    return uuid.uuid4().hex


def encode_state(status: int, headers, body: bytes, default_headers, date_header: bool) -> bytes:
    """A channel message from the API process: /health's answer (status, raw headers, body) and uvicorn's default
    headers (`config.encoded_headers`, and whether it sends a date header)."""
    return json.dumps({"status": status, "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in headers],
                       "body": body.decode("latin-1"), "date_header": date_header,
                       "default_headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in default_headers]
                       }).encode()


def _decode_headers(pairs) -> list[tuple[bytes, bytes]]:
    return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in pairs]


@dataclass(eq=False)
class _Held:
    """A connection watched here: until its request is complete (`reading`), or idle between two probes on a
    kept-alive connection. `deadline` closes it: the header timeout, or the keep-alive one."""

    sock: socket.socket
    client: tuple
    deadline: float
    reading: bool = True


class HealthListener:
    """`request_ids`: the answer carries the caller's or a new x-request-id, as the engine's app adds one."""

    def __init__(self, sockets: list[socket.socket], channel: socket.socket, *, paths=PROBE_PATHS,
                 header_timeout_s: float, keep_alive_timeout_s: float, request_ids: bool = False):
        self.sockets = sockets
        self._channel = channel
        self._parser = ProbeParser(paths)
        self._header_timeout_s = header_timeout_s
        self._keep_alive_timeout_s = keep_alive_timeout_s
        self._request_ids = request_ids
        self._state: dict | None = None  # the API process's last message; connections wait until the first
        self._heard_at = 0.0  # when the last message came
        self._api_pid = os.getppid()
        self._loop_ran_at = 0.0  # when the API process's event loop last ran, by its last tick
        self._api_was_alive = True
        self._date = (0, b"")
        self._epoll = select.epoll()
        self._listening = {sock.fileno(): sock for sock in sockets}
        self._held: dict[int, _Held] = {}
        self._outbox: list[tuple[socket.socket, float]] = []  # passed to the API process when the channel takes them
        self._next_expiry = float("inf")
        self._accept_paused_until = 0.0
        self._channel_writable = True  # False from a full channel until epoll says it takes more
        self._open = True
        for sock in sockets:
            sock.setblocking(False)  # accepted ones stay blocking (the server's loop makes them not): calls here say MSG_DONTWAIT
        channel.setblocking(False)
        self._epoll.register(channel.fileno(), select.EPOLLIN)

    def run(self) -> None:
        try:
            while self._open:
                now = time.monotonic()
                timeout = min(self._next_expiry, self._accept_paused_until or float("inf")) - now
                for fd, mask in self._epoll.poll(-1 if timeout == float("inf") else max(timeout, 0.0)):
                    if fd == self._channel.fileno():
                        if mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                            self._read_channel()
                        if self._open and mask & select.EPOLLOUT:
                            self._channel_writable = True
                    elif fd in self._listening:
                        self._accept(self._listening[fd])
                    elif fd in self._held:
                        self._serve(self._held[fd])
                if self._outbox and self._channel_writable:
                    self._flush()  # once per round: up to FDS_PER_MESSAGE connections per message
                now = time.monotonic()
                if now >= self._next_expiry:
                    self._expire(now)
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self._listen(True)
        finally:
            for held in self._held.values():
                held.sock.close()
            for sock, _ in self._outbox:
                sock.close()
            for sock in self.sockets:
                sock.close()
            self._epoll.close()

    # ---- the channel to the API process ---------------------------------------------------------------
    def _read_channel(self) -> None:
        while True:
            try:
                message = self._channel.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message = b""
            if not message:  # the API process closed it (shut down) or is gone
                self._open = False
                return
            self._heard_at = time.monotonic()
            if len(message) == TICK.size:
                self._loop_ran_at = TICK.unpack(message)[0]
                continue
            first = self._state is None
            self._state = json.loads(message)
            self._state["headers"] = _decode_headers(self._state["headers"])
            self._state["default_headers"] = _decode_headers(self._state["default_headers"])
            self._state["body"] = self._state["body"].encode("latin-1")
            if first:
                self._listen(True)

    def _flush(self) -> None:
        while self._outbox:
            batch = self._outbox[:FDS_PER_MESSAGE]
            try:
                socket.send_fds(self._channel, [b"".join(DEADLINE.pack(deadline) for _, deadline in batch)],
                                [sock.fileno() for sock, _ in batch])
            except (BlockingIOError, InterruptedError):
                self._channel_writable = False
                self._epoll.modify(self._channel.fileno(), select.EPOLLIN | select.EPOLLOUT)
                return
            except OSError:
                self._open = False
                return
            for sock, _ in batch:
                sock.close()  # the API process holds its own descriptor now
            del self._outbox[:len(batch)]
        self._epoll.modify(self._channel.fileno(), select.EPOLLIN)

    # ---- connections ---------------------------------------------------------------------------------------
    def _listen(self, on: bool) -> None:
        for fd in self._listening:
            if on:
                self._epoll.register(fd, select.EPOLLIN)
            else:
                self._epoll.unregister(fd)

    def _accept(self, listener: socket.socket) -> None:
        """Accepts up to `ACCEPTS_PER_ROUND` connections (the listening socket stays readable for the rest, so that
        connections accepted before are served in between) and looks at each one's request at once: a probe sent
        with its connection is answered before the connections of a burst behind it are even accepted."""
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, client = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as error:
                if error.errno not in _ACCEPT_LIMIT_ERRNOS:
                    raise
                logger.error("socket.accept() out of system resource: %s", error)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                self._listen(False)
                return
            if sock.family in (socket.AF_INET, socket.AF_INET6):  # as uvicorn's own listener (asyncio's does not)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            held = _Held(sock, client, time.monotonic() + self._header_timeout_s)
            self._held[sock.fileno()] = held
            self._next_expiry = min(self._next_expiry, held.deadline)
            # Edge-triggered: woken when bytes arrive, not again for the same bytes left unread by a peek.
            self._epoll.register(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET)
            self._serve(held)

    def _serve(self, held: _Held) -> None:
        """Answers the probes that have arrived, then waits, passes the connection on, or closes it."""
        while True:
            try:
                data = held.sock.recv(PROBE_MAX_BYTES + 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return  # nothing (more) yet
            except OSError:
                self._drop(held)
                return
            if not data:
                self._drop(held)  # the client closed it
                return
            if not held.reading:  # the first byte of the next request on a kept-alive connection
                held.reading = True
                held.deadline = time.monotonic() + self._header_timeout_s
                self._next_expiry = min(self._next_expiry, held.deadline)
            probe = self._parser.parse(data)
            if probe is NEED_DATA:
                return
            if probe is None or not self._api_alive():
                self._forget(held)
                # A request whose headers are complete has met its deadline; waiting for a busy loop is not
                # the client's time (with uvicorn's listener it waited in the accept queue instead).
                self._outbox.append((held.sock, 0.0 if b"\r\n\r\n" in data else held.deadline))
                return
            if not self._respond(held, probe):
                return

    def _api_alive(self) -> bool:
        if time.monotonic() - self._heard_at >= 1.0:
            self._read_channel()  # this process may have been the one that did not run: read what came meanwhile
        stuck_s = time.monotonic() - self._loop_ran_at
        stopped = _stopped(self._api_pid)
        alive = not stopped and stuck_s < LOOP_STUCK_S
        if alive != self._api_was_alive:
            self._api_was_alive = alive
            if alive:
                logger.warning("health listener: the API process runs again; probes are answered here")
            else:
                logger.warning("health listener: the API process is %s; probes go to it",
                               "stopped" if stopped else f"running, but its event loop has not run for {stuck_s:.0f} s")
        return alive

    def _respond(self, held: _Held, probe: Probe) -> bool:
        """Consumes the request and sends the answer; True when the connection stays open for the next request."""
        state = self._state
        headers = [*self._default_headers(state), *state["headers"]]
        if self._request_ids:
            headers.append((b"x-request-id", request_id(probe.headers).encode()))
        status = state["status"]
        output = response(status, headers, state["body"], probe)
        if access_logger.isEnabledFor(logging.INFO):
            access_logger.info('%s - "GET %s HTTP/%s" %d %s', "%s:%d" % held.client[:2], probe.target.decode(),
                               probe.http_version.decode(), status, HTTPStatus(status).phrase)
        try:
            consumed = held.sock.recv(probe.length, socket.MSG_DONTWAIT)  # the bytes just peeked are there
            sent = held.sock.send(output, socket.MSG_DONTWAIT) if len(consumed) == probe.length else 0
        except OSError:
            sent = 0
        if sent != len(output) or not probe.keep_alive:
            self._drop(held)
            return False
        held.reading = False
        held.deadline = time.monotonic() + self._keep_alive_timeout_s
        self._next_expiry = min(self._next_expiry, held.deadline)
        return True

    def _default_headers(self, state: dict) -> list[tuple[bytes, bytes]]:
        """uvicorn's: a date header (refreshed each second) when it sends one, then its server header."""
        if not state["date_header"]:
            return state["default_headers"]
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, email.utils.formatdate(now, usegmt=True).encode())
        return [(b"date", self._date[1]), *state["default_headers"]]

    def _drop(self, held: _Held) -> None:
        self._forget(held)
        held.sock.close()

    def _forget(self, held: _Held) -> None:
        del self._held[held.sock.fileno()]
        self._epoll.unregister(held.sock.fileno())

    def _expire(self, now: float) -> None:
        """Closes connections past their deadline: headers too slow, or idle past the keep-alive timeout."""
        self._next_expiry = float("inf")
        for held in list(self._held.values()):
            if held.deadline <= now:
                try:  # read what was only peeked, so that closing sends a FIN as uvicorn's close does, not a RST
                    held.sock.recv(PROBE_MAX_BYTES + 1, socket.MSG_DONTWAIT)
                except OSError:
                    pass
                self._drop(held)
            else:
                self._next_expiry = min(self._next_expiry, held.deadline)


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (SIGSTOP) or a tracer: the state field of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False  # gone: the channel's end says so


class _LevelPrefix(logging.Formatter):
    """`%(levelprefix)s` as uvicorn's formatter writes it without colours: `INFO:     `."""

    def format(self, record: logging.LogRecord) -> str:
        record.levelprefix = f"{record.levelname}:".ljust(9)
        return super().format(record)


def configure_logging(level: int, log_format: str, access_log: bool) -> None:
    """The server's log format on stderr (access lines on stdout, as uvicorn writes them)."""
    for log, stream, on in ((logger, sys.stderr, True), (access_logger, sys.stdout, access_log)):
        log.propagate = False
        log.setLevel(level if on else logging.CRITICAL + 1)
        handler = logging.StreamHandler(stream)
        handler.setFormatter(_LevelPrefix(log_format))
        log.handlers = [handler]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="a server's health listener (started by it)")
    parser.add_argument("--listen-fd", type=int, action="append", required=True)
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--path", action="append", default=[])
    parser.add_argument("--header-timeout", type=float, required=True)
    parser.add_argument("--keep-alive-timeout", type=float, required=True)
    parser.add_argument("--request-ids", action="store_true")
    parser.add_argument("--log-level", type=int, default=logging.WARNING)
    parser.add_argument("--log-format", default=UVICORN_LOG_FORMAT)
    parser.add_argument("--access-log", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process drains on these, then closes the channel
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(args.log_level, args.log_format, args.access_log)
    sockets = [socket.socket(fileno=fd) for fd in args.listen_fd]
    channel = socket.socket(fileno=args.channel_fd)
    HealthListener(sockets, channel, paths=[path.encode() for path in args.path] or PROBE_PATHS,
                   header_timeout_s=args.header_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                   request_ids=args.request_ids).run()


if __name__ == "__main__":
    main()
