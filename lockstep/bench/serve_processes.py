"""`lockstep bench serve --num-client-processes K`: the requests spread over K spawned client
processes that start at one common instant; the parent merges their raw per-request results.

Request i goes from process i % K, at its offset from the common start; --max-concurrency is split
as evenly as it goes. Every wait on a process is bounded: one that fails, exits early or falls
silent ends the run with a BenchmarkError naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TextIO

from lockstep.bench.serve_client import BenchmarkError, Progress, RequestResult, make_client, send_on_schedule
from lockstep.bench.workload import WorkloadRequest
from lockstep_common.processes import stop_processes

# Client processes: spawning one and importing httpx takes about a second; a loaded machine, more.
PROCESS_STARTUP_TIMEOUT_S = 60.0
# How far in the future the common start instant lies once every process is ready: time to read it.
PROCESS_START_LEAD_S = 0.2
# A running client process says it is alive this often, so a hung one is told from a long stream.
PROCESS_HEARTBEAT_S = 1.0
# A client process silent this long (no heartbeat, completion or result) is taken as hung.
PROCESS_SILENCE_TIMEOUT_S = 30.0
# How long a process that has sent its results, or was told to stop, may take to exit.
PROCESS_EXIT_TIMEOUT_S = 10.0


@dataclass
class ClientPlan:
    """What one client process sends: its requests (by index in the whole workload) and their offsets."""

    url: str
    headers: dict[str, str]
    model: str
    timeout_s: float
    process_index: int = 0
    max_concurrency: int | None = None
    # the model each request names (`--lora-modules` spreads them over adapters); empty: `model` for all
    models: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    requests: list[WorkloadRequest] = field(default_factory=list)
    offsets: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TimedResult:
    """One request's result from a client process, with absolute (time.time()) send and finish times."""

    index: int
    result: RequestResult
    sent_at: float
    finished_at: float


def concurrency_shares(max_concurrency: int | None, num_processes: int) -> list[int | None]:
    """--max-concurrency split as evenly as it goes: the first (max % K) processes get one more."""
    if max_concurrency is None:
        return [None] * num_processes
    base, extra = divmod(max_concurrency, num_processes)
    return [base + (j < extra) for j in range(num_processes)]


def max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """The most (start, end) intervals open at one instant; one ending as another starts is not overlap."""
    # At equal times the end (-1) sorts before the start (+1).
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


def client_process_main(conn: Connection, plan: ClientPlan) -> None:
    """A client process: say ready, wait for the common start instant, send the plan's requests at
    their offsets (reporting each completion), then send back the results, or the error."""
    try:
        conn.send(("ready",))
        # The parent sends the start once every process is ready, or stops them all.
        if not conn.poll(2 * PROCESS_STARTUP_TIMEOUT_S):
            raise BenchmarkError(f"no start instant from the parent within {2 * PROCESS_STARTUP_TIMEOUT_S:.0f} s")
        _, start_at = conn.recv()
        results = asyncio.run(_client_process_run(conn, plan, start_at))
        conn.send(("results", results))
    except KeyboardInterrupt:
        sys.exit(1)
    # Anything that stops this process is the run's failure; the parent names it.
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        with contextlib.suppress(OSError, EOFError, ValueError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    finally:
        conn.close()


async def _client_process_run(conn: Connection, plan: ClientPlan, start_at: float) -> list[TimedResult]:
    # perf_counter times the requests; time.time() is the clock the processes share.
    wall_minus_perf = time.time() - time.perf_counter()

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(PROCESS_HEARTBEAT_S)
            conn.send(("alive",))

    models = plan.models or [plan.model] * len(plan.requests)
    async with make_client(plan.timeout_s, plan.max_concurrency) as client:
        beating = asyncio.create_task(heartbeat())
        try:
            results, finished, _ = await send_on_schedule(
                client, plan.url, plan.headers, models, plan.requests, plan.offsets,
                start_at - wall_minus_perf, plan.max_concurrency, lambda r: conn.send(("done", r.success)),
            )  # fmt: skip
        finally:
            beating.cancel()
    return [
        TimedResult(index, result, result.start_time + wall_minus_perf, end + wall_minus_perf)
        for index, result, end in zip(plan.indices, results, finished, strict=True)
    ]


class ClientProcesses:
    """The parent's side of the client processes: one duplex pipe each, every wait bounded."""

    def __init__(self, plans: Sequence[ClientPlan]) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        # when each process was last heard from, reset by each receive()
        self.last_heard: list[float] = []
        try:
            for plan in plans:
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=client_process_main, args=(child_end, plan), name=f"bench-serve-client-{plan.process_index}"
                )
                # daemon: a parent that dies takes its client processes with it
                process.daemon = True
                process.start()
                # Only the child holds its end now, so its death reads as end-of-file here.
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
        except BaseException:
            self.stop()
            raise

    def name(self, j: int) -> str:
        return f"client process {j} of {len(self.processes)} (pid {self.processes[j].pid})"

    def receive(
        self, waiting: set[int], handle: Callable[[int, tuple], bool], silence_s: float, waiting_for: str
    ) -> None:
        """Pass each message to `handle(j, message)` until it has returned True for every process in
        `waiting`. Raises BenchmarkError for a process that fails, exits first or is silent `silence_s`."""
        now = time.monotonic()
        self.last_heard = [now] * len(self.processes)
        while waiting:
            wait([self.conns[j] for j in waiting] + [self.processes[j].sentinel for j in waiting], timeout=1.0)
            for j in sorted(waiting):
                conn = self.conns[j]
                try:
                    while j in waiting and conn.poll():
                        message = conn.recv()
                        self.last_heard[j] = time.monotonic()
                        if message[0] == "error":
                            raise BenchmarkError(f"{self.name(j)} failed: {message[1]}")
                        if handle(j, message):
                            waiting.discard(j)
                except (EOFError, OSError):
                    # Its end of the pipe closed before the message awaited: it is exiting.
                    self.processes[j].join(PROCESS_EXIT_TIMEOUT_S)
                    raise BenchmarkError(self._exited(j, waiting_for)) from None
                if j not in waiting:
                    continue
                if not self.processes[j].is_alive():
                    raise BenchmarkError(self._exited(j, waiting_for))
                if time.monotonic() - self.last_heard[j] > silence_s:
                    raise BenchmarkError(f"{self.name(j)} sent nothing for {silence_s:.0f} s, {waiting_for}")

    def _exited(self, j: int, waiting_for: str) -> str:
        code = self.processes[j].exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {_signal_name(-code)}"
        else:
            how = f"exited with code {code}"
        return f"{self.name(j)} {how}, {waiting_for}"

    def send_all(self, message: tuple) -> None:
        for j, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except OSError:
                raise BenchmarkError(self._exited(j, "before the start instant reached it")) from None

    def stop(self, exit_s: float = 0.0) -> None:
        """Give the processes `exit_s` seconds to exit by themselves, then terminate (or kill) the rest."""
        deadline = time.monotonic() + exit_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        stop_processes(self.processes, PROCESS_EXIT_TIMEOUT_S)
        for conn in self.conns:
            conn.close()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def run_client_processes(
    template: ClientPlan,
    requests: Sequence[WorkloadRequest],
    offsets: Sequence[float],
    num_processes: int,
    max_concurrency: int | None,
    progress: TextIO | None,
) -> tuple[list[RequestResult], float, int]:
    """Send request i from process i % num_processes at its offset from a common start instant.
    Returns the results in request order, the duration (last finish - start) and the most in flight."""
    models = template.models or [template.model] * len(requests)
    plans = []
    for j, share in enumerate(concurrency_shares(max_concurrency, num_processes)):
        indices = list(range(j, len(requests), num_processes))
        plans.append(
            ClientPlan(
                url=template.url, headers=template.headers, model=template.model, timeout_s=template.timeout_s,
                process_index=j, max_concurrency=share, models=[models[i] for i in indices], indices=indices,
                requests=[requests[i] for i in indices], offsets=[offsets[i] for i in indices],
            )
        )  # fmt: skip
    timed: dict[int, TimedResult] = {}
    tracker = Progress(len(requests), progress)

    def on_message(j: int, message: tuple) -> bool:
        """True once process j has sent what is awaited of it: "ready", then "results"."""
        kind = message[0]
        if kind == "done":
            tracker.record(message[1])
        elif kind == "results":
            timed.update((t.index, t) for t in message[1])
        return kind in ("ready", "results")

    processes = ClientProcesses(plans)
    try:
        processes.receive(set(range(num_processes)), on_message, PROCESS_STARTUP_TIMEOUT_S, "before it was ready")
        start_at = time.time() + PROCESS_START_LEAD_S
        tracker.started_at = time.perf_counter() + PROCESS_START_LEAD_S
        processes.send_all(("start", start_at))
        processes.receive(
            set(range(num_processes)), on_message, PROCESS_SILENCE_TIMEOUT_S, "before it returned its results"
        )
    except BaseException:
        processes.stop()
        raise
    # Each has sent its results and is exiting; one that lingers is stopped, its results kept.
    processes.stop(PROCESS_EXIT_TIMEOUT_S)
    if len(timed) != len(requests):
        raise BenchmarkError(f"the client processes returned {len(timed)} results for {len(requests)} requests")
    ordered = [timed[i] for i in range(len(requests))]
    duration = max((t.finished_at for t in ordered), default=start_at) - start_at
    max_in_flight = max_overlap([(t.sent_at, t.finished_at) for t in ordered])
    return [t.result for t in ordered], duration, max_in_flight
