"""The engine core's API servers (`lockstep serve --api-server-count N`): which one owns each request, and
where each message from the core goes.

One core serves N API-server processes, each over a pipe of its own; every request of every API server
is scheduled in the one batch. `ClientRouter` sits where the core's writer was: a step's outputs are
split by the API server that sent each request (a window's `TokenBatch` columns are split once per window,
so each API server still gets a window's columns once), a request's failure goes to its owner, and what
concerns all (stats, metrics, readiness, a fatal failure) goes to every API server. With one API server
every message goes straight to it and nothing is tracked.

Request ids carry a random UUID (serving.py), so two API servers never send the same id; should they,
the second request is refused (`own` answers False) rather than have its outputs go to the wrong server,
and an abort ends only requests of the server that sent it.

An API server that leaves (its pipe closed: exit, crash, kill -9; or `Shutdown`) is `remove`d: the core
aborts its requests, so their KV blocks are freed at the window's end, and their outputs are dropped here.
No import of torch: tested on plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

from lockstep_engine import protocol as p


class ClientRouter:
    """Owner bookkeeping and fan-out over the per-API-server writers (anything with `send(message)`)."""

    def __init__(self, writers: list):
        self.writers = writers
        self.live = set(range(len(writers)))
        self._single = len(writers) == 1
        self._owner: dict[str, int] = {}
        self._dead_once: set[str] = set()  # not in the core at the last `prune`
        self._split_window: tuple | None = None  # (window, request_ids list) of the cached split
        self._split: dict[int, Callable] = {}  # API server -> picks its rows out of a step's tokens
        self._columns: dict[int, tuple] = {}  # API server -> its share of the window's columns

    # ---- ownership ---------------------------------------------------------------------------
    def own(self, request_id: str, client: int) -> bool:
        """Records that `client` sent the request; False when another request of that id is still known."""
        if self._single:
            return True
        if self._owner.setdefault(request_id, client) != client:
            return False
        self._dead_once.discard(request_id)
        return True

    def owner(self, request_id: str) -> int | None:
        return 0 if self._single else self._owner.get(request_id)

    def remove(self, client: int) -> list[str]:
        """The API server left: no more messages to it; returns the ids of its requests (to abort)."""
        self.live.discard(client)
        self.writers[client].close()
        if self._single:
            return []
        gone = [rid for rid, owner in self._owner.items() if owner == client]
        for rid in gone:
            del self._owner[rid]
        return gone

    def prune(self, is_known: Callable[[str], bool]) -> None:
        """Forgets the owners of requests the core no longer knows at two calls in a row (one call per loop
        round: a window's last step may be delivered during the next window's, so an id is kept one round
        after its request ended)."""
        if self._single:
            return
        dead = {rid for rid in self._owner if not is_known(rid)}
        for rid in dead & self._dead_once:
            del self._owner[rid]
        self._dead_once = dead - self._dead_once

    # ---- messages ----------------------------------------------------------------------------
    def send(self, message) -> None:
        if self._single:
            self.writers[0].send(message)
        elif isinstance(message, p.StepOutputs):
            self._send_step(message)
        elif isinstance(message, p.RequestFailed):
            self.send_to(self._owner.get(message.request_id), message)
        else:
            for client in list(self.live):
                self.writers[client].send(message)

    def send_to(self, client: int | None, message) -> None:
        if client in self.live:
            self.writers[client].send(message)

    def flush(self, timeout_s: float) -> None:
        for client in list(self.live):
            self.writers[client].flush(timeout_s)

    def _send_step(self, step: p.StepOutputs) -> None:
        outputs: dict[int, list[p.SequenceOutput]] = {}
        for output in step.outputs:
            client = self._owner.get(output.request_id)
            if client is not None:
                outputs.setdefault(client, []).append(output)
        batches = self._split_batch(step.batch) if step.batch is not None else {}
        for client in self.live & (outputs.keys() | batches.keys()):
            self.writers[client].send(p.StepOutputs(outputs.get(client, []), step.emitted_at, batches.get(client)))

    def _split_batch(self, batch: p.TokenBatch) -> dict[int, p.TokenBatch]:
        """Each API server's rows of one step's batch; the column split is made once per window."""
        key = (batch.window, id(batch.request_ids))
        if self._split_window != key:
            self._split_window = key
            rows: dict[int, list[int]] = {}
            for row, rid in enumerate(batch.request_ids):
                client = self._owner.get(rid)
                if client is not None:
                    rows.setdefault(client, []).append(row)
            self._split = {client: _picker(mine) for client, mine in rows.items()}
            self._columns = {client: tuple(list(pick(column)) for column in (
                batch.request_ids, batch.indices, batch.num_cached_tokens, batch.scheduled_at))
                for client, pick in self._split.items()}
        tokens = batch.token_ids
        return {client: p.TokenBatch(*self._columns[client], list(pick(tokens)), batch.window)
                for client, pick in self._split.items()}


def _picker(rows: list[int]) -> Callable:
    """A function that picks `rows` out of a sequence as a tuple: `itemgetter`, in C (a list comprehension
    cost the core's loop three times as much per step at 256 rows)."""
    if len(rows) == 1:
        row = rows[0]
        return lambda values: (values[row],)
    return itemgetter(*rows)
