"""`StepClock`: device time of each forward and the idle gaps between forwards, without waiting.

On CUDA the marks are timing events recorded on the current stream; on the CPU host-clock marks with
the same interface, so both run the same pending/harvest logic.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from lockstep_engine.runner.outputs import StepTag, StepTiming


class HostMark:
    """A host-clock mark with the part of `torch.cuda.Event`'s interface the clock uses: complete once
    recorded, so the CPU runs the same pending/harvest logic as CUDA."""

    __slots__ = ("at",)

    def __init__(self):
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostMark) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event


def cuda_timing_event():
    return torch.cuda.Event(enable_timing=True)


@dataclass
class _Forward:
    """A forward whose marks were recorded but not yet harvested."""

    tag: StepTag
    start: object
    end: object | None  # None while the forward runs on the host side (between start() and end())
    after_previous: bool  # the idle time since the previous forward ended counts as a gap


class StepClock:
    """Times forwards and the idle gaps between them for the runner's lifetime.

    Marks come from a pool made once (CUDA events, recorded on the current stream, or host-clock marks
    on the CPU) and are reused round-robin. `harvest()` never waits: it walks the recorded forwards in
    order and stops at the first whose marks the device has not reached (`query()`); those are harvested
    by a later call. Only when every mark of the pool is pending and unfinished does the clock wait for
    the oldest forward (`num_forced_syncs` counts it; 0 in steady state, where each window harvests its
    own after its outputs reached the host).
    """

    def __init__(self, device: torch.device, pool_size: int = 512, mark_factory: Callable[[], object] | None = None):
        # Pending forwards hold 2 marks each and the last harvested end is kept for the next gap: with 4
        # marks an exhausted pool always holds a completed forward to wait for.
        if pool_size < 4:
            raise ValueError(f"pool_size={pool_size} is too small (expected at least 4)")
        if mark_factory is None:
            mark_factory = cuda_timing_event if device.type == "cuda" else HostMark
        self._free = deque(mark_factory() for _ in range(pool_size))
        self._pending: deque[_Forward] = deque()
        self._previous_end = None  # end mark of the last harvested forward, kept for the next gap
        self._after_previous = False  # whether the next start() follows the previous forward at once
        self._ready: list[StepTiming] = []
        self.num_forced_syncs = 0

    def begin_window(self, continuing: bool) -> None:
        """Before a window's first start(): its idle time since the previous forward is a gap only when
        the window follows the previous one at once; the first step after idle has none."""
        if self._pending and self._pending[-1].end is None:  # a window that raised left its start open
            self.drop_start()
        self._after_previous = continuing

    def start(self, tag: StepTag) -> None:
        mark = self._take()
        mark.record()
        self._pending.append(_Forward(tag, mark, None, self._after_previous))

    def end(self) -> None:
        mark = self._take()
        mark.record()
        self._pending[-1].end = mark
        self._after_previous = True

    def drop_start(self) -> None:
        """Forgets the start just recorded: the step ran nothing."""
        forward = self._pending.pop()
        assert forward.end is None, "drop_start() after end()"
        self._free.append(forward.start)

    def harvest(self) -> list[StepTiming]:
        """Timings of the forwards the device finished since the last harvest, oldest first."""
        self._collect()
        ready, self._ready = self._ready, []
        return ready

    def _take(self):
        if not self._free:
            self._collect()  # harvest fell behind: free what the device has finished, still without waiting
        if not self._free:
            self._wait_oldest()
        return self._free.popleft()

    def _wait_oldest(self) -> None:
        # Every mark is in use, so (pool_size >= 4) the oldest pending forward has both marks recorded.
        self.num_forced_syncs += 1
        oldest = self._pending[0]
        oldest.start.synchronize()
        oldest.end.synchronize()
        self._collect()

    def _collect(self) -> None:
        pending = self._pending
        while pending:
            forward = pending[0]
            if forward.end is None or not forward.end.query() or not forward.start.query():
                return
            pending.popleft()
            previous = self._previous_end
            gap = None
            if previous is not None:
                if forward.after_previous:
                    gap = previous.elapsed_time(forward.start) / 1e3
                self._free.append(previous)
            self._ready.append(StepTiming(forward.tag, forward.start.elapsed_time(forward.end) / 1e3, gap))
            self._free.append(forward.start)
            self._previous_end = forward.end
