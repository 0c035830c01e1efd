"""Results handed to users of the offline API, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep_engine.protocol import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
