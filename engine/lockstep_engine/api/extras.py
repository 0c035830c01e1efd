"""vLLM's extra request parameters that are checked or read outside `SamplingParams`, and how their
results are rendered: `prompt_logprobs`, `echo` with `logprobs`, `return_tokens_as_token_ids`.

A parameter this server cannot honour is a 400 that says why, never silently dropped: vLLM
clients rely on `priority` ordering, and a 200 without it would look like it worked.
"""

from __future__ import annotations

from typing import Callable

from lockstep_engine.protocol import TokenLogprobs
from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.openai_models import CompletionRequest
from lockstep_engine.sampling_params import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS

MAX_BAD_WORDS = MAX_BAD_WORD_SEQUENCES // 2  # each word gives one or two token sequences
MAX_BAD_WORD_CHARS = 1024  # checked before tokenizing (on the event loop): far above 32 tokens of text


# Other servers' spellings this server does not read: a 400 that names the one it reads, never a silent 200.
FOREIGN_FIELDS = {
    "regex": "SGLang's spelling: send structured_outputs={\"regex\": ...} (or guided_regex)",
    "ebnf": "SGLang's spelling: send structured_outputs={\"grammar\": ...} (or guided_grammar)",
    "json_schema": "SGLang's spelling: send response_format={\"type\": \"json_schema\", \"json_schema\": "
                   "{\"name\": ..., \"schema\": ...}} or structured_outputs={\"json\": ...}",
}


# vLLM's extras this server has no machinery for: a value other than "not set" is a 400 saying why.
UNSUPPORTED_EXTRAS = {
    "length_penalty": ("1.0", "it scores beams, and there is no beam search here"),
    "logits_processors": ("null or []", "no request-supplied logits processors are loaded"),
    "vllm_xargs": ("null or {}", "no custom logits processors read extra arguments"),
    "kv_transfer_params": ("null", "there is no disaggregated prefill (KV transfer) between servers"),
    "cache_salt": ("null", "the prefix cache is not partitioned by salt; use a server per tenant"),
    "return_token_ids": ("false or null", "token ids come back with return_tokens_as_token_ids and logprobs"),
    "mm_processor_kwargs": ("null or {}", "only text-only models are served"),
}
MAX_REQUEST_ID_CHARS = 256


def check(body, config) -> None:
    extra = body.model_extra or {}
    for name, hint in FOREIGN_FIELDS.items():
        if extra.get(name) is not None:
            raise bad_request(f"{name}: this server does not read a top-level {name!r} ({hint})", name)
    for name, (allowed, why) in UNSUPPORTED_EXTRAS.items():
        value = getattr(body, name, None)
        unset = value is None or value is False or (isinstance(value, (list, dict)) and not value)
        if not (unset or (name == "length_penalty" and value == 1.0)):
            raise bad_request(f"{name}={_short(value)}: not supported ({why}); send {allowed} or leave it out", name)
    request_id = body.request_id
    if request_id is not None and not (0 < len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isprintable()
                                       and request_id.isascii()):
        raise bad_request(f"request_id: expected 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters, got "
                          f"{len(request_id)} characters", "request_id")
    if body.use_beam_search:
        raise bad_request("use_beam_search=true: beam search is not supported; send use_beam_search=false "
                          "(or leave it out) for sampling", "use_beam_search")
    if body.priority not in (None, 0) and config.scheduling_policy != "priority":
        # vLLM's rule: only the priority policy orders by it, and a value it would ignore is an error.
        raise bad_request(f"priority={body.priority!r}: Got priority {body.priority} but Priority scheduling is not "
                          f"enabled (this server's --scheduling-policy is {config.scheduling_policy!r}); send "
                          f"priority 0", "priority")
    if body.prompt_logprobs is not None and body.stream:
        # As in vLLM: a stream has no place for them (echo with logprobs streams the prompt's logprobs).
        raise bad_request(f"prompt_logprobs={body.prompt_logprobs!r} is not available when stream is true; "
                          f"send stream=false or leave prompt_logprobs out", "prompt_logprobs")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def sampling_extras(body, serving) -> dict:
    """The `SamplingParams` fields of vLLM's extras: the token masks and `truncate_prompt_tokens`."""
    return {**token_masks(body, serving.encode, serving.model_config.vocab_size),
            "truncate_prompt_tokens": body.truncate_prompt_tokens}


def token_masks(body, encode, vocab_size: int) -> dict:
    """`allowed_token_ids` checked against the vocabulary, and `bad_words` tokenized as vLLM does."""
    outside = next((t for t in body.allowed_token_ids or () if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise bad_request(f"allowed_token_ids: token id {outside} is outside the vocabulary (0..{vocab_size - 1})",
                          "allowed_token_ids")
    return {"allowed_token_ids": body.allowed_token_ids,
            "bad_words_token_ids": bad_words_token_ids(body.bad_words, encode, vocab_size) if body.bad_words else None}


def bad_words_token_ids(words: list[str], encode, vocab_size: int) -> list[list[int]]:
    """vLLM's rule: each word without its leading blanks, and with one space before it when that spelling
    starts with another token and has as many tokens (a word at the start of the text and in the middle of
    it). The engine never samples a sequence's last token right after its other tokens."""
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"bad_words: {len(words)} words; at most {MAX_BAD_WORDS} are allowed", "bad_words")
    long = next((word for word in words if len(word) > MAX_BAD_WORD_CHARS), None)
    if long is not None:
        raise bad_request(f"bad_words: a word of {len(long)} characters; at most {MAX_BAD_WORD_CHARS} characters "
                          f"and {MAX_BAD_WORD_TOKENS} tokens are allowed", "bad_words")
    sequences = []
    for word in words:
        plain = encode(word.lstrip(), False, "bad_words")
        if not plain:
            raise bad_request(f"bad_words: {word!r} has no tokens; send words with text in them", "bad_words")
        spaced = encode(" " + word.lstrip(), False, "bad_words")
        longest = max(len(plain), len(spaced))
        if longest > MAX_BAD_WORD_TOKENS:
            raise bad_request(f"bad_words: {word[:60]!r} is {longest} tokens; at most {MAX_BAD_WORD_TOKENS} are "
                              f"allowed", "bad_words")
        sequences.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    outside = next((t for word in sequences for t in word if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise bad_request(f"bad_words: token id {outside} of the tokenizer is outside the model's vocabulary "
                          f"(0..{vocab_size - 1})", "bad_words")
    return sequences


def truncate_prompts(prompts: list[list[int]], keep: int | None, max_model_len: int) -> None:
    """`truncate_prompt_tokens`, in place: each prompt's last `keep` tokens (-1: max_model_len), as vLLM."""
    if keep is None:
        return
    keep = max_model_len if keep == -1 else keep
    for ids in prompts:
        if len(ids) > keep:
            ids[:] = ids[-keep:]


def continuous_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats)


def prompt_logprobs(body) -> int | None:
    """The engine's `prompt_logprobs`: the request's, or on /v1/completions with echo its `logprobs`
    (vLLM's rule: the echoed prompt tokens get logprobs like the generated ones)."""
    if body.prompt_logprobs is None and isinstance(body, CompletionRequest) and body.echo:
        return body.logprobs
    return body.prompt_logprobs


def token_renderer(body, token_str: Callable[[int], str]) -> Callable[[int], str]:
    """How logprobs name tokens: their text, or with return_tokens_as_token_ids "token_id:<id>" (vLLM's
    spelling, for clients that need ids where a token is not valid UTF-8 alone)."""
    if body.return_tokens_as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return token_str


def echoed(state, entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
    """Completions logprobs of the echoed prompt, then `entries`: the first prompt token has a null
    logprob and null top logprobs (nothing predicts it), as in OpenAI's legacy API."""
    first = TokenLogprobs(state.prompt_token_ids[0], None, 0, None)
    return [first, *(state.prompt_logprobs or []), *entries]


def prompt_logprobs_field(state, token_str: Callable[[int], str]) -> list | None:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per token a map
    token id -> {logprob, rank, decoded_token} of the prompt's own token and the top k."""
    entries = state.prompt_logprobs_by_position()
    if entries is None:
        return None

    def position(entry: TokenLogprobs) -> dict:
        out = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                     "decoded_token": token_str(entry.token_id)}}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            out.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": token_str(token_id)})
        return out

    return [None if entry is None else position(entry) for entry in entries]
