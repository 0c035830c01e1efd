"""`EngineCoreClient`: the API server's side of the engine-core process.

It spawns the core, sends it `lockstep_engine.protocol` messages and turns what comes back into per-request
events on the asyncio loop. Detokenization and stop strings happen here, in the API process, through
the engine's `OutputProcessor`; a stop string found here is sent back so the core stops computing.
The event loop reads the core's pipe when it is readable (`PipeReader`: no reader thread, whose turns
at the GIL would hold up every socket write the loop makes); a watchdog marks the core dead when its
process exits, its heartbeat stops, or its loop stops making progress, and every request in flight then
ends with an error instead of hanging.

With `--api-server-count N` the supervisor (entrypoints/api_servers.py) spawns the core and gives each
API server one end of a duplex pipe to it (`core_conn`): nothing is spawned here, the core's death reads as
the end of that pipe (or a silent heartbeat), and `shutdown` only says that this API server leaves.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass, field

from lockstep_common.processes import stop_processes
from lockstep_engine import protocol as p
from lockstep_engine.api import core_launch, metrics
from lockstep_engine.log import log
from lockstep_engine.output_processor import OutputProcessor, RequestState
from lockstep_engine.pipe_reader import PipeReader
from lockstep_engine.pipe_sender import PipeSender

WATCHDOG_INTERVAL_S = 0.25
SHUTDOWN_TIMEOUT_S = 10.0
# Messages for the core not yet written to its pipe; beyond it new requests get 503. Requests in flight
# are bounded by memory (--max-queued-memory-bytes), and each puts a few messages here at most: this only
# catches a core that stopped reading. A burst of a few thousand requests sent at once is written to the
# pipe more slowly than it arrives, so the bound is far above any burst the memory budget admits.
MAX_PENDING_SENDS = 65536


class EngineBusyError(RuntimeError):
    """The engine cannot take another request now (its queue is full); the client may retry later."""


class EngineDeadError(RuntimeError):
    """The engine core is gone or stuck; requests in flight cannot finish."""


class RequestRejected(ValueError):
    """The core refused a request the API server had accepted."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


@dataclass
class Generation:
    """One request the API server is waiting on: one or more core requests (one per prompt)."""

    request_ids: list[str]
    states: list[RequestState]
    updated: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    last_emitted_at: float = 0.0  # StepOutputs.emitted_at of the latest update (for latency metrics)
    unannounced: int = -1  # tokens since `updated` was last set for tokens (-1: none announced yet, the first goes at once)
    waiting_since: float | None = None  # time.monotonic() when the current `wait` began; None: not waiting
    idle_timeout_s: float = 0.0  # the current `wait`'s timeout
    timed_out: bool = False  # set by the client's watchdog (`EngineCoreClient._expire_idle`)

    @property
    def finished(self) -> bool:  # asked several times per streamed chunk
        states = self.states
        return states[0].finished if len(states) == 1 else all(state.finished for state in states)

    async def wait(self, timeout_s: float) -> None:
        """Waits for news (tokens, a finish or an error); raises on an error or a timeout. The timeout
        counts the engine's silence, not this request's: while the engine sends tokens for others (this
        request waits in its queue, or was preempted back to it), the wait goes on. The client's watchdog
        ends the wait once neither the wait began nor the engine sent tokens within `timeout_s`; no timer
        is armed per wait (a stream waits once per update, and a timer cost as much as the wake-up)."""
        if self.error is None and not self.finished and not self.updated.is_set():
            self.idle_timeout_s, self.waiting_since = timeout_s, time.monotonic()
            try:
                await self.updated.wait()
            finally:
                self.waiting_since = None
            if self.timed_out and self.error is None:
                self.timed_out = False
                self.updated.clear()
                raise asyncio.TimeoutError
        self.updated.clear()
        if self.error is not None:
            raise self.error

    async def next_update(self, idle_timeout_s: float) -> None:
        """`wait` for a stream: an engine silent for idle_timeout_s counts as dead (the stream ends with
        an error event rather than hanging)."""
        try:
            await self.wait(idle_timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"no output from the engine for {idle_timeout_s:.0f} s") from None


@dataclass
class CoreTimeouts:
    startup_s: float = 1800.0  # loading a large model from a slow disk
    heartbeat_s: float = 5.0  # no message at all from the core (heartbeats every 0.5 s) for this long: dead
    loop_stall_s: float = 300.0  # the loop made no progress (no step, no idle wait) for this long: stuck


class EngineCoreClient:
    def __init__(self, config, timeouts: CoreTimeouts | None = None, max_requests: int | None = None,
                 core_conn=None, stream_interval: int = 1):
        self.config = config  # EngineConfig as given; the core resolves it against the model
        self.stream_interval = stream_interval  # a generation's tokens per wake-up (--stream-interval)
        self.timeouts = timeouts or CoreTimeouts()
        self.max_requests = max_requests  # core requests in flight (running + waiting); None: unbounded
        self.on_dead = None  # called once with the reason when a loaded core dies or stops answering
        self.processor: OutputProcessor | None = None  # once the core sent the tokenizer
        self.ready: p.CoreReady | None = None
        self.stats = p.EngineStats()
        self.core_metrics: p.CoreMetrics | None = None  # the core's latest step-timing snapshot
        self.dead_reason: str | None = None
        self._generations: dict[str, Generation] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_event: asyncio.Event | None = None
        self._last_heard = 0.0
        self._loop_progress_at = 0.0
        self._last_output_at = 0.0  # monotonic time the latest StepOutputs arrived
        self._process = None
        self._core_conn = core_conn  # a core shared with other API servers: the supervisor started it
        self._send_conn = None
        # Messages are written from the event loop without blocking it; a core that stopped reading fills
        # the pipe, and what does not fit waits in the sender's thread (`PipeSender`).
        self._sender: PipeSender | None = None
        self._reader: PipeReader | None = None
        self._watchdog: asyncio.Task | None = None
        self._columns = p.ColumnCache()  # the core sends a window's token-batch columns once
        self.adapters: dict[str, str] = {}  # registered LoRA adapters, name -> path (the core's `Adapters`)
        self.max_loras = 0
        self._adapter_calls: dict[str, asyncio.Future] = {}  # load/unload calls waiting for the core's answer

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawns the core process; returns at once (`wait_ready` waits for the model)."""
        self._loop = asyncio.get_running_loop()
        self._ready_event = asyncio.Event()
        if self._core_conn is not None:
            self._attach(self._core_conn, self._core_conn)
            return
        ctx = multiprocessing.get_context("spawn")
        to_core_recv, to_core_send = ctx.Pipe(duplex=False)
        from_core_recv, from_core_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=core_launch.run_core,
                                    args=(core_launch.CORE_ENTRY_POINT, self.config, to_core_recv, from_core_send),
                                    name="lockstep-engine-core")
        self._process.start()
        # Close our copies of the child's ends, so a dead child reads as EOF here.
        to_core_recv.close()
        from_core_send.close()
        self._attach(from_core_recv, to_core_send)

    def _attach(self, recv_conn, send_conn) -> None:
        self._send_conn = send_conn
        self._sender = PipeSender(send_conn, self._pipe_failed, name="lockstep-core-writer")
        self._last_heard = self._loop_progress_at = time.monotonic()
        self._reader = PipeReader(recv_conn, self._loop, self._on_message, self._pipe_closed)
        self._watchdog = asyncio.create_task(self._watch())

    async def wait_ready(self) -> p.CoreReady:
        waiter = asyncio.ensure_future(self._ready_event.wait())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.timeouts.startup_s)
        except asyncio.TimeoutError:
            self._mark_dead(f"the engine core did not load the model within {self.timeouts.startup_s:.0f} s")
        if self.ready is None:
            raise EngineDeadError(self.dead_reason or "the engine core failed to start")
        return self.ready

    @property
    def is_healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    async def shutdown(self) -> None:
        """Stops the core: a Shutdown message, then terminate/kill after a timeout. Idempotent."""
        self.on_dead = None  # the core exiting now is the shutdown asked for, not a fatal loss
        if self._watchdog is not None:
            self._watchdog.cancel()
        process = self._process
        if process is None:
            if self._send_conn is not None and self.dead_reason is None:
                self._send(p.Shutdown())  # this API server leaves; the core goes on for the others
                deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
                while self._sender.pending and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            self._fail_all(EngineDeadError("the server is shutting down"))
            self._stop_reading()
            return
        if self.dead_reason is None:
            self._send(p.Shutdown())
            deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            while process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        elif process.is_alive():  # stuck or frozen (SIGSTOP): it cannot shut down by itself
            process.kill()
            process.join(5.0)
        stop_processes([process], timeout_s=5.0)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._stop_reading()
        if self._send_conn is not None:
            self._send_conn.close()

    def _stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.close()

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, request_ids: list[str], prompts: list[list[int]], params, prompt_texts: list[str | None],
               lora_name: str | None = None) -> Generation:
        """Queues one core request per prompt (same params) and returns what to wait on."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine core is not ready")
        if self.max_requests is not None and len(self._generations) + len(request_ids) > self.max_requests:
            raise EngineBusyError(f"the engine has {len(self._generations)} requests in flight, its limit is "
                                  f"{self.max_requests} (--max-num-seqs + --max-queued-requests); retry later")
        if self._sender is not None and self._sender.pending >= MAX_PENDING_SENDS:
            raise EngineBusyError(f"the engine core is not reading its requests ({self._sender.pending} queued); "
                                  f"retry later")
        sampling = params.to_dict()
        states = [self.processor.add_request(rid, text, ids, params)
                  for rid, ids, text in zip(request_ids, prompts, prompt_texts)]
        generation = Generation(list(request_ids), states)
        now = time.monotonic()
        for rid, ids in zip(request_ids, prompts):
            self._generations[rid] = generation
            metrics.request_started(rid, now, len(ids), params)
            self._send(p.AddRequest(rid, list(ids), sampling, now, lora_name))
        return generation

    async def adapter_call(self, message: p.LoadAdapter | p.UnloadAdapter, timeout_s: float = 120.0) -> p.AdapterReply:
        """Sends a LoRA adapter load or unload to the core and waits for its answer."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine core is not ready")
        future = self._adapter_calls[message.call_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(message)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._adapter_calls.pop(message.call_id, None)

    def abort(self, generation: Generation) -> None:
        """Stops a generation's unfinished requests (client gone); their blocks are freed by the core."""
        pending = [rid for rid, state in zip(generation.request_ids, generation.states) if not state.finished]
        self.release(generation)
        if pending and self.is_healthy:
            self._send(p.AbortRequests(pending))

    def abort_all(self) -> None:
        """Aborts every request in flight; their streams end with finish_reason 'abort'."""
        if self._generations and self.is_healthy:
            self._send(p.AbortRequests(list(self._generations)))

    def release(self, generation: Generation) -> None:
        """Forgets a generation (answered, or aborted by `abort`), counting how each sample ended."""
        for rid, state in zip(generation.request_ids, generation.states):
            if self._generations.pop(rid, None) is None:
                continue
            metrics.request_finished(rid, state, "abort")
            self.processor.remove(rid)

    def _send(self, message) -> None:
        if self._sender is not None:
            self._sender.send(message)
            if isinstance(message, p.Shutdown):
                self._sender.close()

    def _pipe_failed(self, error: OSError) -> None:  # from the loop or the sender's thread
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._mark_dead, f"the engine core pipe is closed ({error})")

    # ---- what comes back --------------------------------------------------------------------
    def _pipe_closed(self, reason: str) -> None:  # end of file, or a read error
        self._mark_dead("the engine core process exited")

    def _on_message(self, message, received_at: float) -> None:
        self._last_heard = max(self._last_heard, received_at)
        if isinstance(message, p.StepOutputs):
            if message.batch is not None:
                message.batch = self._columns.restore(message.batch)
            self._loop_progress_at = max(self._loop_progress_at, message.emitted_at)
            self._last_output_at = received_at
            metrics.observe_output_ipc(received_at - message.emitted_at)
            started = time.perf_counter()
            self._on_outputs(message)
            metrics.observe_detokenize(time.perf_counter() - started)
        elif isinstance(message, p.EngineStats):
            self.stats = message
        elif isinstance(message, p.CoreMetrics):
            self.core_metrics = message
        elif isinstance(message, p.Adapters):
            self.adapters, self.max_loras = dict(message.adapters), message.max_loras
        elif isinstance(message, p.AdapterReply):
            future = self._adapter_calls.get(message.call_id)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, p.Heartbeat):
            self._loop_progress_at = max(self._loop_progress_at, message.loop_progress_at)
            self.stats = message.stats if self.ready is not None else self.stats
        elif isinstance(message, p.RequestFailed):
            generation = self._generations.get(message.request_id)
            if generation is not None:
                generation.error = (RuntimeError(message.message) if message.internal
                                    else RequestRejected(message.message, message.param))
                generation.updated.set()
                self.abort(generation)
        elif isinstance(message, p.CoreReady):
            eos = tuple(message.model_config.get("eos_token_ids") or ())
            self.processor = OutputProcessor(message.tokenizer, eos)
            self.ready = message
            self._loop_progress_at = time.monotonic()
            self._ready_event.set()
        elif isinstance(message, p.CoreFailed):
            if self.ready is not None:  # while loading, the server's loader logs why it failed
                log(f"error: {message.message}")  # the whole traceback goes to the log, its last line to clients
            self._mark_dead(_summary(message.message))

    def _on_outputs(self, message: p.StepOutputs) -> None:
        for output in message.all_outputs():
            generation = self._generations.get(output.request_id)
            if generation is None:
                continue  # aborted or already answered
            try:
                state, stop = self.processor.process(output)
            except Exception as error:  # a bug in output processing must end the request, not hang it
                log(f"error: output processing of {output.request_id} failed: {error!r}")
                generation.error = RuntimeError(f"output processing failed: {type(error).__name__}")
                generation.updated.set()
                self.abort(generation)
                continue
            if state is not None:
                metrics.tokens_received(output.request_id, output.index, len(state.sequences[output.index].token_ids),
                                        output.scheduled_at)
            if stop is not None:
                self._send(p.StopSequence(output.request_id, output.index, stop))
            generation.last_emitted_at = message.emitted_at
            if self._announce(generation, stop is not None):
                generation.updated.set()

    def _announce(self, generation: Generation, stopping: bool) -> bool:
        """Whether an output wakes its generation's waiter (vLLM's --stream-interval): always with an
        interval of 1; else its first token, every `stream_interval`-th token after it (over all its
        samples), and its end (a finish, or a stop string found, whose finish follows)."""
        if self.stream_interval == 1:
            return True
        generation.unannounced += 1
        if generation.unannounced > 0 and generation.unannounced < self.stream_interval \
                and not stopping and not generation.finished:
            return False
        generation.unannounced = 0
        return True

    # ---- health -----------------------------------------------------------------------------
    async def _watch(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            if self._process is not None and not self._process.is_alive():
                self._mark_dead(f"the engine core process exited with code {self._process.exitcode}")
            elif self.ready is None:
                continue  # loading: the startup timeout applies
            elif now - self._last_heard > self.timeouts.heartbeat_s and not self._heard_now():
                self._mark_dead(f"no heartbeat from the engine core for {now - self._last_heard:.1f} s")
            elif now - self._loop_progress_at > self.timeouts.loop_stall_s:
                self._mark_dead(f"the engine core loop made no progress for {now - self._loop_progress_at:.1f} s")
            elif now - self._last_output_at >= WATCHDOG_INTERVAL_S:  # while tokens flow, no wait can be over
                self._expire_idle(now)

    def _heard_now(self) -> bool:
        """Whether the pipe holds news the loop has not read yet (a loop held up past the heartbeat timeout
        runs this check before the reader's turn): a loop behind on its callbacks is no silent core."""
        heard = self._last_heard
        if self._reader is not None:
            self._reader.read_available()
        return self._last_heard > heard

    def _expire_idle(self, now: float) -> None:
        """Ends each `Generation.wait` whose timeout passed with the engine silent since the wait began."""
        for generation in {id(g): g for g in self._generations.values()}.values():  # one a prompt each
            since = generation.waiting_since
            if since is not None and now - max(since, self._last_output_at) >= generation.idle_timeout_s:
                generation.timed_out = True
                generation.updated.set()

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if self._ready_event is not None:
            self._ready_event.set()
        self._fail_all(EngineDeadError(f"engine core failed: {reason}"))
        if self.ready is not None and self.on_dead is not None:
            self.on_dead(reason)

    def _fail_all(self, error: Exception) -> None:
        for rid, generation in list(self._generations.items()):
            if generation.error is None:
                generation.error = error
            generation.updated.set()
            state = self.processor.states.pop(rid, None)
            metrics.request_finished(rid, state, "error")
        self._generations.clear()
        for future in self._adapter_calls.values():
            if not future.done():
                future.set_exception(error)


def _summary(message: str) -> str:
    """A core failure report without its traceback: the first line and the exception's line."""
    lines = [line for line in message.splitlines() if line.strip()]
    if len(lines) <= 1 or not any(line.startswith("Traceback") for line in lines):
        return message
    return f"{lines[0].rstrip(':')}: {lines[-1].strip()}"
