"""`CoreStats`: what the engine core counts and samples as it runs windows (the metrics read snapshots of it
from `EngineCore.take_stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lockstep_engine.runner.outputs import SpecCounts, StepTiming, WindowTimings


@dataclass
class CoreStats:
    """The engine core's counters (cumulative) and per-step samples (since the last `take`). Only the core
    writes here; readers (metrics, benchmarks) take a snapshot."""

    num_windows: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    num_wasted_tokens: int = 0
    num_cut_windows: int = 0  # ended before their planned steps (`step`: an arrival, a prompt's next chunk)
    # Windows whose last step the next window handed over (overlap); the others delivered every step
    # themselves (overlap off, or a row whose sampling needs its tokens on the host)
    num_overlapped_windows: int = 0
    spec: SpecCounts | None = None  # speculative decoding's proposals and acceptances (None: no speculation)
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    output_s: float = 0.0
    update_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # idle between steps inside a window
    boundary_gaps_s: list[float] = field(default_factory=list)  # idle between back-to-back windows
    decode_step_s: list[float] = field(default_factory=list)  # steps 2..N of windows: pure decode
    decode_step_batch: list[int] = field(default_factory=list)  # rows in each of those steps
    window_steps: list[int] = field(default_factory=list)
    step_batch_sizes: list[int] = field(default_factory=list)
    later_step_batches: list[int] = field(default_factory=list)  # the same for steps after their window's first
    first_step_tokens: list[int] = field(default_factory=list)  # tokens fed to each window's first forward
    queue_times_s: list[float] = field(default_factory=list)  # arrival -> first scheduled, once per request
    # Device timings taken when the engine went idle (`EngineCore._go_idle`): the last window's last steps,
    # which its own harvest found still running and no later window would harvest.
    idle_steps: list[StepTiming] = field(default_factory=list)

    def take(self) -> "CoreStats":
        """A snapshot: the counters so far and the samples recorded since the previous `take`, which
        this object then forgets (a long-running server's memory stays flat)."""
        snapshot = replace(self)
        for name in _SAMPLE_LISTS:
            setattr(self, name, [])
        return snapshot

    def record_timings(self, timings: WindowTimings) -> None:
        """A window's host phases and the device timings harvested with it (possibly some of an
        earlier window's steps: they arrive as the device finishes them)."""
        self.prepare_s += timings.prepare_s
        self.output_s += timings.output_s
        if timings.spec is not None:
            self.spec = timings.spec.plus(self.spec)
        for timed in timings.steps:
            self.forward_s += timed.forward_s
            if timed.tag.step > 1:
                self.decode_step_s.append(timed.forward_s)
                self.decode_step_batch.append(timed.tag.batch)
            if timed.gap_s is not None:
                (self.gaps_s if timed.tag.step > 1 else self.boundary_gaps_s).append(timed.gap_s)


_SAMPLE_LISTS = ("gaps_s", "boundary_gaps_s", "decode_step_s", "decode_step_batch", "window_steps",
                 "step_batch_sizes", "later_step_batches", "first_step_tokens", "queue_times_s", "idle_steps")
