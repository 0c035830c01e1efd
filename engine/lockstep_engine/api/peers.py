"""One API server among the N of `lockstep serve --api-server-count N`: what it shares with the others.

Prometheus scrapes one process per connection, and the kernel hands each connection to any of the N
API servers, so each /metrics must give the totals over all of them. The engine core's series (step
timing, scheduler gauges and counters) reach every API server alike, from the one core. The series the
API servers observe themselves (requests, TTFT, inter-token latency, tokens, finish reasons, their host
phases and stream delay) are summed: each API server writes the state of its own into the run directory
the supervisor made (`api-server-I.metrics`, replaced whole, at most every `PUBLISH_INTERVAL_S` while it
changes), and a scrape adds the other servers' latest files to its own live state. A scrape through any
server thus gives the same totals once the servers have been idle for `PUBLISH_INTERVAL_S`; while traffic
flows, another server's part is at most that old (a Prometheus scrape interval is seconds).

A server writes its first file once its core is ready: `/health` answers 200 only when every API server's
file is there, so a probe through any connection says whether all of them can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable

PUBLISH_INTERVAL_S = 0.1
SUFFIX = ".metrics"


@dataclass
class ApiServerGroup:
    index: int  # 0..count-1
    count: int
    run_dir: str  # made by the supervisor, removed when it exits
    core_conn: Any = None  # this server's end of its pipe to the shared engine core

    def path(self, index: int) -> str:
        return os.path.join(self.run_dir, f"api-server-{index}{SUFFIX}")


class Peers:
    """Publishes this server's metric state and reads the others'."""

    def __init__(self, group: ApiServerGroup, state: Callable[[], Any]):
        self.group = group
        self._state = state  # this server's own state, picklable
        self._published: bytes | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.publish()
        self._task = asyncio.create_task(self._publish_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            self.publish()

    def publish(self) -> None:
        data = pickle.dumps(self._state(), protocol=pickle.HIGHEST_PROTOCOL)
        if data == self._published:
            return
        path = self.group.path(self.group.index)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)  # a reader sees the old file or the new one, never half of one
        self._published = data

    def others(self) -> list[Any]:
        """The latest published state of every other API server (those that published one)."""
        states = []
        for index in range(self.group.count):
            if index == self.group.index:
                continue
            with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
                with open(self.group.path(index), "rb") as handle:
                    states.append(pickle.load(handle))
        return states

    def all_ready(self) -> bool:
        """Whether every API server has published (its core is ready) and none was lost (the supervisor
        removes a lost server's file). A few stat calls: cheap enough for the probe thread's 50 ms rounds."""
        return all(os.path.exists(self.group.path(i)) for i in range(self.group.count))
