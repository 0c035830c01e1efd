"""/tokenize and /detokenize (vLLM's): a prompt or chat to token ids and back, with the server's tokenizer
and chat template."""

from __future__ import annotations

from lockstep_engine.api.errors import bad_request
from lockstep_engine.api.openai_models import DetokenizeRequest, TokenizeRequest


def tokenize(serving, body: TokenizeRequest) -> dict:
    """`serving`: the server's `OpenAIServing`."""
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("expected exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        tokens = serving.chat_prompt(body.messages, body.add_generation_prompt is not False, False, None)
    else:
        tokens = serving.encode(body.prompt, body.add_special_tokens is not False)
    result = {"count": len(tokens), "max_model_len": serving.config.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = [serving.token_str(t) for t in tokens]
    return result


def detokenize(serving, body: DetokenizeRequest) -> dict:
    serving.check_model(body.model)
    if serving.tokenizer is None:
        raise bad_request(f"tokens: model {serving.model_name!r} has no tokenizer", "tokens")
    vocab = serving.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is not a token id in [0, {vocab})", "tokens")
    return {"prompt": serving.decode(body.tokens)}


# A completion prompt read on the event loop rather than in a worker thread (`OpenAIServing.create_completion`):
# the hop costs the loop more than tokenizing this much text or copying this many token ids does.
INLINE_PROMPT_CHARS, INLINE_PROMPT_IDS = 2048, 16384


def inline_prompt(prompt) -> bool:
    items = [prompt] if isinstance(prompt, str) or prompt and isinstance(prompt[0], int) else prompt
    if not isinstance(items, list):
        return False
    chars = ids = 0
    for item in items:
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, list):
            ids += len(item)
    return chars <= INLINE_PROMPT_CHARS and ids <= INLINE_PROMPT_IDS
