"""What a window hands back to the engine core and metrics: per-step outputs and device timings.

Plain Python, no torch: the engine core and the metrics import these types without the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from lockstep_common import metrics_names as n
from lockstep_engine.protocol import TokenLogprobs


# Why a row's sequence ended at this step, as the device decided it (`Steps.advance`); the host
# applies it and only adds what the device cannot see (stop strings, aborts).
FINISH_NONE = 0  # still running (or done at an earlier step: its token is -1)
FINISH_STOP = 1  # sampled EOS or a stop token id
FINISH_LENGTH = 2  # reached max_tokens or max_model_len


@dataclass
class StepOutput:
    """One step of a window on the host: a token per sampling row, or -1 where the row was done, and
    each row's finish code (FINISH_*)."""

    step: int
    tokens: list[int]
    finish: list[int] | None = None  # None: no row finished (rows of a micro-batch with nothing to run)
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Step 1 of a window whose rows asked for prompt logprobs hands them over first, in an output of
    # their own (no tokens), before any token of the window: plan row index -> its chunk's logprobs.
    prompt_logprobs: dict[int, "PromptLogprobs"] | None = None


@dataclass
class PromptLogprobs:
    """Logprobs of the prompt tokens one row's step-1 chunk predicts: entry j is of prompt token
    `start + j + 1`, from the logits at position `start + j`. The top lists hold the largest k of
    the window's rows; each request keeps its own k."""

    start: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def extend(self, request) -> None:
        """Appends the entries `request.prompt_logprobs` lacks (a recomputed prompt brings them again)."""
        known, k, prompt = request.prompt_logprobs, request.params.prompt_logprobs, request.prompt_token_ids
        for j in range(max(len(known) - self.start, 0), len(self.logprobs)):
            top = list(zip(self.top_ids[j][:k], self.top_logprobs[j][:k]))
            known.append(TokenLogprobs(prompt[self.start + j + 1], self.logprobs[j], self.ranks[j], top))


@dataclass(frozen=True)
class StepTag:
    """What the runner knows of a forward when it starts it; its timing may be harvested a window later."""

    step: int  # 1-based step of its window; step 1 follows the window boundary
    phase: str  # prefill: a window's first step that computed prompt tokens; decode otherwise
    batch: int  # sampling rows of its window


@dataclass(frozen=True)
class StepTiming:
    """One forward's device time (forward + sample + advance) and the idle time before it."""

    tag: StepTag
    forward_s: float
    gap_s: float | None  # since the previous forward ended; None: the first step after idle


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding's proposals and acceptances (vLLM's spec_decode counters), of a window or summed."""

    num_drafts: int = 0  # (row, step) pairs that proposed tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()  # drafts accepted at draft position j (0..K-1)

    def plus(self, other: "SpecCounts | None") -> "SpecCounts":
        if other is None:
            return self
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        per_pos = [0] * width
        for counts in (self.accepted_per_pos, other.accepted_per_pos):
            for j, count in enumerate(counts):
                per_pos[j] += count
        return SpecCounts(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                          self.num_accepted_tokens + other.num_accepted_tokens, tuple(per_pos))

    def counters(self) -> dict[str, dict[tuple, float]]:
        """The engine's spec_decode counter series (lockstep_common.metrics_names), by label values."""
        return {n.SPEC_DRAFTS: {(): float(self.num_drafts)}, n.SPEC_DRAFT_TOKENS: {(): float(self.num_draft_tokens)},
                n.SPEC_ACCEPTED_TOKENS: {(): float(self.num_accepted_tokens)},
                n.SPEC_ACCEPTED_PER_POS: {(str(j),): float(c) for j, c in enumerate(self.accepted_per_pos)}}


@dataclass
class WindowTimings:
    prepare_s: float = 0.0
    output_s: float = 0.0  # host callbacks (output processing)
    num_steps: int = 0  # forwards this window executed
    # Forwards whose device timing completed since the previous window's harvest, oldest first: mostly
    # this window's, plus earlier ones still running when their own window ended.
    steps: list[StepTiming] = field(default_factory=list)
    # The window's last step when it was left undelivered for the next window to hand over (overlap):
    # a `runner.host_stream.WindowTail`; None when every step was delivered.
    tail: object = None
    spec: SpecCounts | None = None  # a speculative window's proposals and acceptances


class Guide(Protocol):
    """Guided decoding for the sampling rows of one window (see lockstep_engine.guided).

    Rows constrained by a grammar need the token of step k before the mask of step k+1 exists, so a
    window with guided rows synchronises with the host once per step; other windows never do.
    """

    def allowed_mask(self): ...  # torch.Tensor [rows, vocab] bool on the device

    def accept(self, tokens: list[int]) -> None: ...  # -1: the row produced nothing this step


GuideFactory = Callable[[list], "Guide | None"]
