"""Messages between the API server process and the engine-core process.

Plain dataclasses, pickled over a pipe: no torch, no web framework, nothing else from the engine, so
the API-server process and a test import them without loading the model code. They stay inside the
engine: the gateway speaks to an engine over HTTP (OpenAI's JSON), not with these messages. The API side sends requests, aborts and stop-string hits; the
core answers with one `StepOutputs` per decode step (streaming is per token, not per window), the
stats the scheduler sees, and a heartbeat that proves its loop is alive.

A decode step's common rows (a token, nothing else: no logprobs, no finish, not a sample's first
token) travel as one `TokenBatch` of columns rather than an object each: pickling 256 objects per
step cost the core's writer about ten times what a few lists cost, and the reader as much again.

`SequenceOutput` and `TokenLogprobs` are also the engine's own types: `EngineCore` emits them and
`Sequence.logprobs` holds them, so the core process ships its outputs as they are (no copy per
token) and the in-process `LLMEngine` reads the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Union


# ---- API server -> engine core -------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields, already validated by the API server
    arrival_time: float  # time.monotonic() of the API server (one clock per host)
    lora_name: str | None = None  # the LoRA adapter the request's `model` named; None: the base model


@dataclass
class LoadAdapter:
    """/v1/load_lora_adapter: register the adapter at `path` under `name` (answered by `AdapterReply`)."""

    call_id: str
    name: str
    path: str


@dataclass
class UnloadAdapter:
    call_id: str
    name: str


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class StopSequence:
    """The API server's output processor found a stop string: the sequence ends there."""

    request_id: str
    index: int
    stop: str


@dataclass
class Shutdown:
    pass


# ---- engine core -> API server -------------------------------------------------------------
@dataclass
class CoreReady:
    pid: int
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    num_scheduler_steps: Union[int, str]
    guided_decoding: bool  # a grammar library and a tokenizer are there for response_format
    device: str
    model_config: dict[str, Any]  # the engine's ModelConfig fields (vocab, EOS ids, context length)
    # The Hugging Face tokenizer the core loaded, pickled along (None: token ids only). Loading it
    # once, in the core, spares the API server from parsing the model file a second time.
    tokenizer: Any = None


@dataclass
class AdapterReply:
    """The answer to a `LoadAdapter` or `UnloadAdapter`, to the API server that asked: `error` None on
    success, else the reason with the HTTP status it maps to (400: the adapter or the name; 404: no such
    adapter)."""

    call_id: str
    error: str | None = None
    status: int = 200


@dataclass
class Adapters:
    """The registered LoRA adapters, (name, path) in registration order: sent to every API server at start
    and whenever the list changes."""

    adapters: list[tuple[str, str]]
    max_loras: int


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class SequenceOutput:
    """New tokens of one sample of a request at one step, as the engine core emits them."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    scheduled_at: float | None = None  # time.monotonic() of the request's first schedule (vLLM's queue time)
    # With a sample's first token, when the request asked for them: entry i is of prompt token i + 1
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class TokenBatch:
    """One step's token for many samples, as columns (entry i is one sample); a token of -1: none
    for that sample this step. Each entry means `SequenceOutput(request_id, index, [token], None,
    num_cached_tokens=..., scheduled_at=...)`. The columns other than `token_ids` are one window's:
    the core builds them once and shares them between its steps' batches (never changed after)."""

    request_ids: list[str] | None
    indices: list[int] | None
    num_cached_tokens: list[int] | None
    scheduled_at: list[float | None] | None
    token_ids: list[int]
    # The window whose columns these are. Over the core's pipe a window's columns travel with its first
    # batch only: the later ones carry None and the reader puts back the columns it kept (`ColumnCache`).
    window: int = 0

    def outputs(self) -> Iterator[SequenceOutput]:
        for request_id, index, cached, scheduled_at, token in zip(
                self.request_ids, self.indices, self.num_cached_tokens, self.scheduled_at, self.token_ids):
            if token >= 0:
                yield SequenceOutput(request_id, index, [token], None, None, None, cached, scheduled_at)


class ColumnCache:
    """One end of the core's pipe: the writer sends a window's `TokenBatch` columns once (`strip`), the
    reader restores them on the window's later batches (`restore`). Pickling 256 request ids at every
    step cost the writer thread more than the step's tokens; one window's columns are sent once instead
    of N times. The pipe keeps order, so the reader always has the columns before a stripped batch."""

    def __init__(self):
        self._window: int | None = None
        self._columns: tuple | None = None

    def strip(self, batch: TokenBatch) -> TokenBatch:
        if batch.window == self._window:
            return TokenBatch(None, None, None, None, batch.token_ids, batch.window)
        self._window = batch.window
        return batch

    def restore(self, batch: TokenBatch) -> TokenBatch:
        if batch.request_ids is not None:
            self._window = batch.window
            self._columns = (batch.request_ids, batch.indices, batch.num_cached_tokens, batch.scheduled_at)
            return batch
        if batch.window != self._window:
            raise ValueError(f"a token batch of window {batch.window} came without its columns "
                             f"(the last columns were of window {self._window})")
        return TokenBatch(*self._columns, batch.token_ids, batch.window)


@dataclass
class StepOutputs:
    outputs: list[SequenceOutput]  # the step's other outputs (logprobs, finishes, first tokens, aborts)
    emitted_at: float  # time.monotonic() when the core handed the step over
    batch: TokenBatch | None = None

    def all_outputs(self) -> Iterator[SequenceOutput]:
        """Every output of the step, the batch's expanded (no order between samples is implied)."""
        yield from self.outputs
        if self.batch is not None:
            yield from self.batch.outputs()


@dataclass
class RequestFailed:
    """The core refused a request it was sent (e.g. the prompt can never fit the KV cache), or ended
    one on an error of its own (`internal`: a 500, not the client's fault); other requests go on."""

    request_id: str
    message: str
    param: str | None = None
    internal: bool = False


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_steps: int = 0
    num_windows: int = 0
    num_generated_tokens: int = 0
    busy_s: float = 0.0  # forward + sample time summed over steps
    num_preemptions: int = 0
    # Device busy time over busy + idle time of the forwards of the last few seconds (idle: the gaps
    # between back-to-back forwards; time with no request at all does not count), 0..1
    gpu_occupancy: float = 0.0
    # LoRA adapters with running / waiting requests, sorted names (vllm:lora_requests_info)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


@dataclass
class CoreMetrics:
    """Cumulative step-timing and scheduler metrics of the core (built and rendered by lockstep_engine.metrics).

    Keyed by metric name, then by label values (after `model_name`, which the API server adds); a
    histogram's value is (per-bucket counts with +Inf last, sum). Cumulative, so only the latest counts.
    """

    counters: dict[str, dict[tuple[str, ...], float]]
    histograms: dict[str, dict[tuple[str, ...], tuple[list[int], float]]]
    taken_at: float  # time.monotonic() in the core


@dataclass
class Heartbeat:
    sent_at: float
    loop_progress_at: float  # last time the core loop finished a step or an idle wait
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass
class CoreFailed:
    """The core hit an error it cannot go on from (at load or in the loop); it exits after this."""

    message: str


ToCore = Union[AddRequest, AbortRequests, StopSequence, Shutdown, LoadAdapter, UnloadAdapter]
FromCore = Union[CoreReady, StepOutputs, RequestFailed, EngineStats, CoreMetrics, Heartbeat, CoreFailed, AdapterReply,
                 Adapters]
