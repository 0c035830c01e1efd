"""vLLM's extra request parameters that are checked or read outside `SamplingParams`, and how their
results are rendered: `prompt_logprobs`, `echo` with `logprobs`, `return_tokens_as_token_ids`.

A parameter this server cannot honour is a 400 that says why, never silently dropped: vLLM
clients rely on `priority` ordering, and a 200 without it would look like it worked.
"""

from __future__ import annotations

from typing import Callable

from lockstep.protocol import TokenLogprobs
from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.openai_models import CompletionRequest


def check(body, config) -> None:
    if body.priority not in (None, 0) and config.scheduling_policy != "priority":
        # vLLM's rule: only the priority policy orders by it, and a value it would ignore is an error.
        raise bad_request(f"priority={body.priority!r}: Got priority {body.priority} but Priority scheduling is not "
                          f"enabled (this server's --scheduling-policy is {config.scheduling_policy!r}); send "
                          f"priority 0", "priority")
    if body.prompt_logprobs is not None and body.stream:
        # As in vLLM: a stream has no place for them (echo with logprobs streams the prompt's logprobs).
        raise bad_request(f"prompt_logprobs={body.prompt_logprobs!r} is not available when stream is true; "
                          f"send stream=false or leave prompt_logprobs out", "prompt_logprobs")


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
