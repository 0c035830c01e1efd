"""`SamplingParams`: per-request generation parameters, as vLLM names and bounds them."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from lockstep_engine.config import ConfigError

INT64_MAX = 2**63 - 1  # the engine keeps top_k, max_tokens, min_tokens and seeds in int64 tensors
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_MASK_TOKEN_IDS = 1 << 18  # allowed_token_ids: a whole vocabulary fits
MAX_BAD_WORD_SEQUENCES = 256  # bad_words_token_ids: two spellings of 128 words
MAX_BAD_WORD_TOKENS = 32  # tokens of one bad word: the window keeps each row's last 31 outputs on the device


class SamplingParamsError(ConfigError):
    """A sampling parameter is out of range; the message names the field, the value and the range."""

    def __init__(self, param: str, value: Any, allowed: str):
        self.param = param
        shown = repr(value)
        if len(shown) > 80:  # a 4000-digit integer or a long string: enough to recognise it
            shown = f"{shown[:60]}...<{len(shown)} characters>"
        super().__init__(f"{param}={shown} is invalid: expected {allowed}")


def _check(ok: bool, param: str, value: Any, allowed: str) -> None:
    if not ok:
        raise SamplingParamsError(param, value, allowed)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int64(value: Any, low: int = 0) -> bool:
    return _is_int(value) and low <= value <= INT64_MAX


def _is_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one is always added)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token after the first (the prompt's own added)
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's tokenized `bad_words`: a sequence's last token is never sampled right after its other tokens
    # (a one-token sequence is never sampled at all); the tokens before it are outputs, never the prompt.
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len); the API applies it
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_schema: dict | None = None  # guided decoding; None: unconstrained
    guided: dict | None = None  # a guided spec (guided_schema.GUIDED_KINDS); wins over json_schema
    priority: int = 0  # scheduling_policy "priority": lower first (vLLM's request priority); ignored otherwise

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, max_logprobs: int = 20) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= 128, "n", self.n, "an integer in [1, 128]")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature", self.temperature,
               "a number in [0, 100]")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_int64(self.top_k), "top_k", self.top_k, f"-1, 0 (off) or a positive integer up to {INT64_MAX}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "a number in [0, 1]")
        if self.seed is not None:
            _check(_is_int(self.seed) and -(2**63) <= self.seed < 2**64, "seed", self.seed, "a 64-bit integer")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"<{len(self.stop)} strings>",
               f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               next((s for s in self.stop if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS), None),
               f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"<{len(self.stop_token_ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        bad = next((t for t in self.stop_token_ids if not _is_int64(t)), None)
        _check(bad is None, "stop_token_ids", bad, "non-negative token ids")
        if self.max_tokens is not None:
            _check(_is_int64(self.max_tokens, 1), "max_tokens", self.max_tokens, f"a positive integer up to {INT64_MAX}")
        _check(_is_int(self.priority) and -INT64_MAX - 1 <= self.priority <= INT64_MAX, "priority", self.priority,
               f"an integer in [{-INT64_MAX - 1}, {INT64_MAX}]")
        _check(_is_int64(self.min_tokens), "min_tokens", self.min_tokens, f"a non-negative integer up to {INT64_MAX}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"at most max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, value, "a number in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               self.repetition_penalty, "a number in (0, 2]")
        if self.logprobs is not None:
            _check(_is_int(self.logprobs) and 0 <= self.logprobs <= max_logprobs, "logprobs", self.logprobs,
                   f"an integer in [0, {max_logprobs}]")
        if self.prompt_logprobs is not None:
            _check(_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= max_logprobs, "prompt_logprobs",
                   self.prompt_logprobs, f"an integer in [0, {max_logprobs}] (max_logprobs)")
        if self.logit_bias:
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias", f"<{len(self.logit_bias)} entries>",
                   f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
            for token, bias in self.logit_bias.items():
                _check(_is_int64(token), "logit_bias", token, "non-negative token ids as keys")
                _check(_is_number(bias) and -100.0 <= bias <= 100.0, "logit_bias", bias, "biases in [-100, 100]")

        ids = self.allowed_token_ids
        if ids is not None:
            _check(isinstance(ids, list) and 0 < len(ids) <= MAX_MASK_TOKEN_IDS, "allowed_token_ids",
                   f"<{len(ids)} ids>" if isinstance(ids, list) else ids,
                   f"a list of 1 to {MAX_MASK_TOKEN_IDS} token ids")
            bad = next((t for t in ids if not _is_int64(t)), None)
            _check(bad is None, "allowed_token_ids", bad, "non-negative token ids")
        self._validate_bad_words()
        if self.truncate_prompt_tokens is not None:
            _check(_is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1
                                                              or self.truncate_prompt_tokens == -1),
                   "truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 (max_model_len) or a positive integer")

    def _validate_bad_words(self) -> None:
        words = self.bad_words_token_ids
        if words is None:
            return
        _check(isinstance(words, list) and len(words) <= MAX_BAD_WORD_SEQUENCES, "bad_words_token_ids",
               f"<{len(words)} sequences>" if isinstance(words, list) else words,
               f"a list of at most {MAX_BAD_WORD_SEQUENCES} token-id lists")
        bad = next((w for w in words if not isinstance(w, list) or not 0 < len(w) <= MAX_BAD_WORD_TOKENS
                    or not all(map(_is_int64, w))), None)
        _check(bad is None, "bad_words_token_ids", bad,
               f"lists of 1 to {MAX_BAD_WORD_TOKENS} non-negative token ids")

    @property
    def single_token_bad_words(self) -> list[int]:
        """Tokens never sampled: the bad words of one token (the logit bias masks them)."""
        return [word[0] for word in self.bad_words_token_ids or () if len(word) == 1]

    @property
    def multi_token_bad_words(self) -> list[tuple[int, ...]]:
        """Bad words of several tokens, deduplicated: the window bans each one's last token on the device
        where the row's latest outputs are its other tokens (`sampler.ban_bad_words`)."""
        return list(dict.fromkeys(tuple(word) for word in self.bad_words_token_ids or () if len(word) > 1))

    def masked_logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        """`logit_bias` with the tokens that `allowed_token_ids` leaves out and the one-token bad words at
        -inf, as vLLM masks them: the runner adds it to the logits at every step of a window."""
        banned = self.single_token_bad_words
        if not self.allowed_token_ids and not banned:
            return self.logit_bias or None
        bias = dict(self.logit_bias or {})
        if self.allowed_token_ids:
            allowed = set(self.allowed_token_ids)
            bias = {token: value for token, value in bias.items() if token in allowed}
            bias.update(dict.fromkeys((t for t in range(vocab_size) if t not in allowed), -math.inf))
        bias.update(dict.fromkeys(banned, -math.inf))
        return bias

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data, as `lockstep_engine.protocol.AddRequest.sampling` carries them. Shallow: the
        message is pickled anyway, and `asdict`'s deep copy of a 100,000-choice list took a second of the
        API process's event loop."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """The inverse of `to_dict`; validates again (ValueError naming the field, TypeError on an unknown key)."""
        return cls(**data)

    @property
    def guided_spec(self) -> dict | None:
        """The request's grammar constraint as a guided spec; None: unconstrained."""
        if self.guided is not None:
            return self.guided
        return None if self.json_schema is None else {"json": self.json_schema}

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_filtering(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
