"""Output processing outside the engine loop: incremental detokenization and stop strings.

Text is released only once it is valid UTF-8 (a multi-byte character split across tokens is held
back), and a stop string is cut out of the text exactly where it starts, even when it spans tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep_engine.protocol import SequenceOutput, TokenLogprobs

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)
        # Decoding starts a few prompt tokens back so leading spaces of the first output come out right.
        self.prefix_offset = max(len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Returns the text this token completes ('' while a character is incomplete)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix):]
        return ""


@dataclass
class SequenceText:
    """The text state of one sample of a request."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    stop: list[str]
    include_stop: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0  # text already handed to a streaming client
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None, is_stop_token: bool) -> str | None:
        """Appends a token; returns the stop string it completed, if any."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detokenizer is None:
            return None
        delta = self.detokenizer.add(token_id)
        if is_stop_token and not self.include_stop:
            return None  # EOS / stop token ids add no text
        if not delta:
            return None
        start = max(len(self.text) - self._max_stop_len() + 1, 0)
        self.text += delta
        if not self.stop:
            return None
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        self.text = self.text[:pos + len(stop)] if self.include_stop else self.text[:pos]
        return stop

    def releasable_text(self) -> str:
        """Text safe to stream: holds back a tail that could still become a stop string."""
        if self.finished or not self.stop:
            return self.text
        return self.text[:max(len(self.text) - self._max_stop_len() + 1, self.sent_text_len)]


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceText]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # of prompt tokens 1.. once the first token came

    def prompt_logprobs_by_position(self) -> list[TokenLogprobs | None] | None:
        """vLLM's layout: one entry per prompt token, None for the first (nothing predicts it)."""
        return None if self.prompt_logprobs is None else [None, *self.prompt_logprobs]

    @property
    def finished(self) -> bool:
        sequences = self.sequences
        return sequences[0].finished if len(sequences) == 1 else all(seq.finished for seq in sequences)


class OutputProcessor:
    """Turns the core's per-step token outputs into text, finishing sequences at stop strings."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> RequestState:
        def make(index: int) -> SequenceText:
            detok = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            return SequenceText(index, detok, list(params.stop), params.include_stop_str_in_output)

        state = RequestState(request_id, prompt, list(prompt_token_ids), [make(i) for i in range(params.n)])
        state.params = params
        self.states[request_id] = state
        return state

    def process(self, output: SequenceOutput) -> tuple[RequestState | None, str | None]:
        """Applies one core output; returns the request state and a stop string that ended it, if any."""
        state = self.states.get(output.request_id)
        if state is None:
            return None, None
        state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = output.prompt_logprobs
        seq = state.sequences[output.index]
        if seq.finished:
            return state, None
        hit = None
        for position, token in enumerate(output.token_ids):
            logprobs = output.logprobs[position] if output.logprobs else None
            is_stop_token = output.finish_reason == "stop" and token in self._stop_ids(state)
            hit = seq.add_token(token, logprobs, is_stop_token)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = "stop", hit
                return state, hit
        if output.finish_reason is not None:
            seq.finish_reason = output.finish_reason
            seq.stop_reason = output.stop_reason
        return state, None

    def _stop_ids(self, state: RequestState) -> set[int]:
        ids = set(state.params.stop_token_ids)
        if not state.params.ignore_eos:
            ids |= self.eos_token_ids
        return ids

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
