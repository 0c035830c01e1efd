"""Listening sockets as `loop.create_server(host=..., port=...)` makes them, bound before a server starts (so that a
health listener process or several SO_REUSEPORT workers can own them), and a child process's tie to its parent."""

from __future__ import annotations

import signal
import socket

PR_SET_PDEATHSIG = 1


def bind_sockets(host: str | None, port: int, backlog: int | None, *, reuse_port: bool = False) -> list[socket.socket]:
    """One socket per address `host` resolves to, SO_REUSEADDR (and SO_REUSEPORT when asked), IPv6 sockets IPv6-only,
    all on one port (the first one's when `port` is 0); listening when `backlog` is given. An OSError names the
    address that could not be bound."""
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as error:
                raise OSError(error.errno, f"error while attempting to bind on address {address!r}: "
                                           f"{(error.strerror or str(error)).lower()}") from None
            if backlog is not None:
                sock.listen(backlog)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def die_with_parent() -> None:
    """SIGTERM to this process when its parent dies, however it dies (Linux; elsewhere nothing). Also usable as a
    `preexec_fn`."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
