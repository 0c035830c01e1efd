"""Request checks against the model and the engine's limits, shared by the API server and `LLMEngine`.

No torch here: the API-server process validates every request before it reaches the core.
"""

from __future__ import annotations

from lockstep_engine.config import EngineConfig
from lockstep_engine.sampling_params import SamplingParams, SamplingParamsError

MAX_PROMPTS = 1024  # prompts in one /v1/completions request, as vLLM caps them
MAX_SEQUENCES = 1024  # prompts x n: the sequences one request may add to the engine
MAX_MESSAGES = 4096  # messages in one chat request


def validate_batch(num_prompts: int, n: int) -> None:
    """Bounds how much work one request may queue: its prompts and its samples per prompt."""
    if num_prompts > MAX_PROMPTS:
        raise SamplingParamsError("prompt", f"<{num_prompts} prompts>", f"at most {MAX_PROMPTS} prompts per request")
    if num_prompts * n > MAX_SEQUENCES:
        raise SamplingParamsError("n", n, f"at most {MAX_SEQUENCES} sequences per request (prompts x n), "
                                          f"here {num_prompts} prompt(s)")


def validate_messages(count: int) -> None:
    if count > MAX_MESSAGES:
        raise SamplingParamsError("messages", f"<{count} messages>", f"at most {MAX_MESSAGES} messages")


def validate_prompt(config: EngineConfig, model_config, token_ids: list[int]) -> None:
    if not token_ids:
        raise SamplingParamsError("prompt", token_ids, "at least one token")
    limit = config.max_model_len
    if len(token_ids) >= limit:  # first: it is cheap, and a huge prompt is then not scanned token by token
        raise SamplingParamsError("prompt", f"<{len(token_ids)} tokens>",
                                  f"fewer than max_model_len={limit} tokens (leaving room for one output token)")
    vocab = model_config.vocab_size
    bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
    if bad is not None:
        raise SamplingParamsError("prompt", bad, f"token ids in [0, {vocab})")


def validate_request(config: EngineConfig, model_config, token_ids: list[int], params: SamplingParams) -> None:
    """Checks a tokenized request against the model and the engine's limits (offline and server alike);
    raises SamplingParamsError naming the bad field."""
    params.validate(config.max_logprobs)
    if params.prompt_logprobs is not None and config.pipeline_parallel_size > 1:
        # Prompt logits exist on the last stage only, and no message brings them to the first.
        raise SamplingParamsError("prompt_logprobs", params.prompt_logprobs,
                                  f"null with pipeline_parallel_size={config.pipeline_parallel_size} (prompt "
                                  f"logprobs need pipeline_parallel_size=1)")
    validate_prompt(config, model_config, token_ids)
    vocab = model_config.vocab_size
    bad_words = [t for word in params.bad_words_token_ids or () for t in word]
    for field_name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or {})),
                            ("allowed_token_ids", params.allowed_token_ids or ()), ("bad_words_token_ids", bad_words)):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise SamplingParamsError(field_name, bad, f"token ids in [0, {vocab})")
    if params.min_tokens > config.max_model_len - len(token_ids):
        raise SamplingParamsError("min_tokens", params.min_tokens,
                                  f"at most {config.max_model_len - len(token_ids)} "
                                  f"(max_model_len={config.max_model_len} minus {len(token_ids)} prompt tokens)")
    if params.max_tokens is not None and len(token_ids) + params.max_tokens > config.max_model_len:
        # Like vLLM: max_tokens may not run past the context window.
        raise SamplingParamsError("max_tokens", params.max_tokens,
                                  f"at most {config.max_model_len - len(token_ids)} "
                                  f"(max_model_len={config.max_model_len} minus {len(token_ids)} prompt tokens)")
