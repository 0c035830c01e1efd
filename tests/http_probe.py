"""Raw HTTP/1.1 on loopback for the health listener tests of the engine and the gateway: a request on a new
connection read to its close, a response split into its parts, a `GET /health` probe; and the listener
processes a server started."""

from __future__ import annotations

import http.client
import os
import socket


def raw(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    """Sends `data` on a new connection and reads until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    return received


def parse(response: bytes) -> tuple[int, list[bytes], dict[bytes, bytes], bytes]:
    """(status, header names lowercased in order, headers by name, body)."""
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = [line.split(b":", 1) for line in lines]
    return int(status_line.split()[1]), [n.lower() for n, _ in headers], {n.lower(): v.strip() for n, v in headers}, body


def probe(port: int, connection: http.client.HTTPConnection | None = None, timeout: float = 10.0) -> int:
    """`GET /health` on `connection` (kept alive) or a new one; its status."""
    connection = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    return response.status


def listener_pids(server_pid: int) -> list[int]:
    """The health listener processes whose parent is `server_pid` (from /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
                if parent == server_pid and b"lockstep_common.health_listener" in cmdline.read():
                    found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found
