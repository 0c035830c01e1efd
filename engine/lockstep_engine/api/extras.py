"""vLLM's extra request parameters that are checked or read outside `SamplingParams`.

A parameter this server cannot honour is a 400 that says why, never silently dropped: vLLM
clients rely on `priority` ordering and on `prompt_logprobs` values, and a 200 without them
would look like they worked.
"""

from __future__ import annotations

from lockstep_engine.api.errors import bad_request


def check(body, config) -> None:
    if body.priority not in (None, 0):
        # The scheduler's policies (config.SCHEDULING_POLICIES) have no priority queue.
        raise bad_request(f"priority={body.priority!r} needs --scheduling-policy priority, which this server does "
                          f"not have (its policy is {config.scheduling_policy!r}); send priority 0", "priority")
    if body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported: the engine computes logits only at each sequence's "
                          "sampling position, not at every prompt token", "prompt_logprobs")
    if body.return_tokens_as_token_ids:
        raise bad_request("return_tokens_as_token_ids is not supported by this server", "return_tokens_as_token_ids")


def continuous_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats)
