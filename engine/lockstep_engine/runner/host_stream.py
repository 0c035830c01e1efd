"""The device-to-host stream of a window's step outputs: pinned buffers kept for the runner's
lifetime, copied into asynchronously, handed to the host callback as each copy lands."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from lockstep_engine.runner.outputs import FINISH_NONE, StepOutput, WindowTimings


def pinned_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


class HostSlot:
    """Host buffers for one step's outputs, and the event that says their copy landed."""

    __slots__ = ("buffers", "event", "views")

    def __init__(self, event):
        self.event = event
        self.buffers: list[torch.Tensor] = []  # 1-D, one per output tensor, grown to the largest seen
        self.views: list[torch.Tensor] = []  # this step's shapes over the buffers

    def copy_from(self, tensors: list[torch.Tensor], allocate: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        self.views = []
        for i, x in enumerate(tensors):
            if i == len(self.buffers):
                self.buffers.append(allocate(_capacity(x.numel()), x.dtype))
            elif self.buffers[i].dtype != x.dtype or self.buffers[i].numel() < x.numel():
                self.buffers[i] = allocate(_capacity(x.numel()), x.dtype)
            self.views.append(self.buffers[i][:x.numel()].view(x.shape).copy_(x, non_blocking=True))
        self.event.record()

    def values(self) -> list:
        return [x.tolist() for x in self.views]


def _capacity(numel: int) -> int:
    return 1 << max(numel - 1, 0).bit_length()  # a power of two: a growing batch reallocates rarely


class HostRing:
    """Pinned host buffers for the asynchronous step copies, kept for the runner's lifetime. A slot goes
    back to the ring only once its copy landed and was read, so a reused buffer is never still being
    written; the ring grows by a slot when a window has more copies in flight than it holds."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] = pinned_buffer,
                 event_factory: Callable[[], object] | None = None):
        self.allocate = allocate
        self.event_factory = event_factory or torch.cuda.Event
        self._free: deque[HostSlot] = deque()
        self.num_slots = 0

    def acquire(self) -> HostSlot:
        if self._free:
            return self._free.popleft()
        self.num_slots += 1
        return HostSlot(self.event_factory())

    def release(self, slot: HostSlot) -> None:
        self._free.append(slot)


class CopyQueue:
    """Step outputs copied into slots of a `HostRing` behind the work that makes them, handed in order to
    `deliver(key, values)` (`values`: the tensors as host lists) once each copy landed."""

    def __init__(self, ring: HostRing, deliver: Callable[[object, list], None]):
        self.ring, self.deliver = ring, deliver
        self.pending: deque[tuple[object, HostSlot]] = deque()

    def __len__(self) -> int:
        return len(self.pending)

    def push(self, key, tensors: list[torch.Tensor], keep: int = 0) -> None:
        """Queues the copy of `tensors`, then delivers the landed copies at the front until `keep` are left."""
        slot = self.ring.acquire()
        slot.copy_from(tensors, self.ring.allocate)
        self.pending.append((key, slot))
        while len(self.pending) > keep and self.pending[0][1].event.query():
            self._deliver(*self.pending.popleft())

    def drain(self, keep: int = 0) -> None:
        """Delivers the pending copies, waiting for each, until `keep` are left."""
        while len(self.pending) > keep:
            key, slot = self.pending.popleft()
            slot.event.synchronize()
            self._deliver(key, slot)

    def _deliver(self, key, slot: HostSlot) -> None:
        values = slot.values()
        self.ring.release(slot)
        self.deliver(key, values)


class StepStream:
    """Hands each step's tokens to the host callback: at once (sync) or as its async copy into a slot of
    the runner's `HostRing` lands.

    With `hold`, the newest `hold` steps are never handed over before later pushes or a drain, even when
    their copies landed at once (a small batch on a fast device) or were synchronous (the CPU): a window's
    last steps are then still there for the next window to hand over (`WindowTail`)."""

    def __init__(self, on_step: Callable[[StepOutput], None], timings: WindowTimings, ring: HostRing | None,
                 hold: int = 0):
        self.on_step = on_step
        self.timings = timings
        self.ring = ring
        self.hold = hold
        self.copies = CopyQueue(ring, lambda key, values: self._deliver(key[0], values, key[1])) if ring else None
        self._held: deque[tuple[int, list, bool]] = deque()  # synchronous steps not handed over yet
        self.last_tokens: list[int] = []

    def push(self, step: int, emitted: torch.Tensor, out, sync: bool) -> None:
        """`emitted`: [2, rows] tokens and finish codes (`DecodeState.emitted`), or [rows] tokens alone."""
        tensors = [emitted]
        if out is not None and out.logprobs is not None:
            tensors += [out.logprobs, out.ranks]
            if out.top_ids is not None:
                tensors += [out.top_ids, out.top_logprobs]
        packed = emitted.dim() == 2
        if sync:
            self._held.append((step, [x.tolist() for x in tensors], packed))
            self._deliver_held(self.hold)
            return
        self.copies.push((step, packed), tensors, keep=self.hold)

    def drain(self, keep: int = 0) -> None:
        """Delivers the steps whose copies are pending, waiting for each, until `keep` are left."""
        if self.copies is not None:
            self.copies.drain(keep)
        self._deliver_held(keep)

    @property
    def undelivered(self) -> int:
        """Steps pushed and not handed over yet."""
        return (len(self.copies) if self.copies is not None else 0) + len(self._held)

    def _deliver_held(self, keep: int) -> None:
        while len(self._held) > keep:
            self._deliver(*self._held.popleft())

    def _deliver(self, step: int, values: list, packed: bool) -> None:
        tokens, finish = values[0] if packed else (values[0], None)
        out = StepOutput(step=step, tokens=tokens, finish=finish)
        if len(values) > 1:
            out.logprobs, out.ranks = values[1], values[2]
            if len(values) > 3:
                out.top_ids, out.top_logprobs = values[3], values[4]
        self.last_tokens = out.tokens
        started = time.perf_counter()
        self.on_step(out)
        self.timings.output_s += time.perf_counter() - started


class WindowTail:
    """A window's last `depth` steps, launched but not handed to the host yet (overlap: the host plans the
    next window meanwhile). The next window's first step takes each continuing row's token and done flag
    from `tokens` and `done` on the device, and hands these steps over (`deliver`) once its own first step
    is queued, so the device runs the next window while the host reads this one.

    `tokens` (each row's last token) and `done` (whether it ended at one of those steps, or before: the
    host knows only of ends before them) are the window's device state after its last step ([rows] of its
    sampling rows, in the window's order): `done` is computed here, `tokens` is read by the next window's
    first step, queued before anything that overwrites it. A row that ended at those steps runs in the
    next window as a done row (no writes, no tokens) until the host learns of its end."""

    def __init__(self, stream: StepStream, tokens: torch.Tensor, emitted: torch.Tensor, seqs: list, depth: int = 1):
        self._stream = stream
        self.tokens = tokens
        # emitted: the last step's [token, finish code] rows; a row that ended at an earlier step emitted -1
        self.done = (emitted[1] != FINISH_NONE) | (emitted[0] < 0)
        self.depth = depth
        self._row_of = {seq: row for row, seq in enumerate(seqs)}
        self.on_delivered: Callable[[], None] | None = None
        self.delivered = False

    def source_rows(self, seqs: list) -> np.ndarray:
        """Each sequence's row in this window (KeyError: a sequence this window did not run)."""
        return np.fromiter(map(self._row_of.__getitem__, seqs), np.int64, len(seqs))

    def hold(self, rows: list, accepted: list[int], executed: int) -> "WindowTail":
        """Counts the tokens the window's sampling `rows` (`ScheduledSeq`, in the window's order) took in
        the held steps as taken: each running row one a step until its planned steps end, in `accepted`
        (tokens per row of the `executed` steps) and `Sequence.num_pending`, so the next window is planned
        from them. They are appended, and the counts cleared, when the steps are delivered."""
        pending = []
        first_held = executed - self.depth  # the steps after this one are held
        for i, row in enumerate(rows):
            seq = row.seq
            held = min(row.max_steps, executed) - first_held
            if held > 0 and not seq.is_finished:
                seq.num_pending = held
                accepted[i] += held
                pending.append(seq)

        def delivered() -> None:
            for seq in pending:
                seq.num_pending = 0

        self.on_delivered = delivered
        return self

    def deliver(self) -> None:
        """Hands the steps to the host callback (once; waits for their copies to land)."""
        if self.delivered:
            return
        self.delivered = True
        self._stream.drain()
        if self.on_delivered is not None:
            self.on_delivered()
