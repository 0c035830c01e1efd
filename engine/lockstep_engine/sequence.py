"""`Request` and `Sequence`: what the scheduler moves around. Plain Python, no torch."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from lockstep_engine.protocol import TokenLogprobs
from lockstep_engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


# A module constant: looking enum members up on their class costs ~0.1 us each (Python 3.11), and this
# is asked for every row of every window.
_FINISHED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: "Request"
    token_ids: list[int]
    index: int = 0  # which of the request's n samples
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    # Only ever appended to: any other change (copy-on-write, freeing) assigns a new list, so the
    # runner's block table keeps the entries of a list it saw before (`runner.step_inputs.BlockTables`).
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    num_forked_blocks: int = 0  # leading blocks it shared with its siblings at the fork (copy-on-write)
    block_hashes: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prepared: bool = False  # its per-request window state is built (`Executor.prepare`)
    # Tokens sampled on the device whose values have not reached the host yet: with overlap, the last steps
    # of a window are handed over while the next window runs, and that window's input for this sequence is
    # the device's copy of the last token (`runner.host_stream.WindowTail`). At most TAIL_STEPS.
    num_pending: int = 0
    sampling_row: object = None  # the runner's sampling constants for it (`runner.step_inputs.SamplingCache`)
    lora_slot: int = 0  # the model's LoRA weight slot it runs with while admitted (0: the base model)
    # The length at which max_tokens or max_model_len ends it: fixed by the request, so that the
    # scheduler's per-row `remaining_tokens` is one subtraction.
    max_num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        request = self.request
        max_tokens = request.params.max_tokens
        self.max_num_tokens = request.max_model_len if max_tokens is None else \
            min(len(request.prompt_token_ids) + max_tokens, request.max_model_len)

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def compute_target(self) -> int:
        """How many tokens must be computed before this sequence samples.

        A request with n > 1 prefills its prompt once, minus the last token, then forks: each child
        computes that last token itself and samples from its own logits.
        """
        if not self.request.forked:
            return self.prompt_len - 1
        return len(self.token_ids)

    @property
    def remaining_tokens(self) -> int:
        """Tokens still allowed by max_tokens / max_model_len."""
        return self.max_num_tokens - len(self.token_ids)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    seed: int  # resolved: the user's seed or one drawn at arrival
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False
    num_cached_tokens: int = 0
    aborted: bool = False
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt tokens 1.. (computed so far)
    adapter: object = None  # its LoRA adapter (`adapter_slots.Adapter`); None: the base model
    # Its sampling reads its own earlier tokens on the host (a grammar, penalties, bad words of several
    # tokens): each window starts from its tokens on the host, so the window before hands every step over.
    needs_host_tokens: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.needs_host_tokens = (params.guided_spec is not None or params.has_penalties
                                  or bool(params.multi_token_bad_words))
        if not self.sequences:
            self.sequences = [Sequence(request=self, token_ids=list(self.prompt_token_ids))]
        if self.params.n == 1:
            self.forked = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.forked and all(seq.is_finished for seq in self.sequences)
