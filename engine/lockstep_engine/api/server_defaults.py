"""Server-wide defaults from `vllm serve`'s flags: the chat template, the response role, default
chat-template kwargs, and the sampling defaults of `--generation-config` / `--override-generation-config`.

Resolved once by `lockstep serve` before the server starts (a bad template or file fails there),
then read by `OpenAIServing` for every request. No torch.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass, field

# generation_config.json keys vLLM takes as sampling defaults (vllm/config ModelConfig.get_diff_sampling_param),
# and the request parameter each one defaults.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_JINJA_CHARS = "{}\n"


class DefaultsError(ValueError):
    """A flag's file or value cannot be used; the message names the flag."""


@dataclass(frozen=True)
class ServerDefaults:
    chat_template: str | None = None  # None: the tokenizer's own
    response_role: str = "assistant"
    chat_template_kwargs: dict = field(default_factory=dict)
    # Request parameter -> default for requests that leave it unset; max_tokens also caps a request's
    # own max_tokens (vLLM takes the smallest of the request's, this and what the context leaves).
    sampling: dict = field(default_factory=dict)

    def value(self, name: str, requested, fallback):
        if requested is not None:
            return requested
        return self.sampling.get(name, fallback)

    def max_tokens(self, requested: int | None) -> int | None:
        limit = self.sampling.get("max_tokens")
        if limit is None:
            return requested
        return limit if requested is None else min(requested, limit)


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a readable file is read; otherwise a string with Jinja characters is the template
    itself (escapes like \\n decoded); otherwise it was meant as a path and that is an error."""
    if value is None:
        return None
    try:
        with open(value) as handle:
            template = handle.read()
    except OSError as error:
        if not any(char in value for char in _JINJA_CHARS):
            raise DefaultsError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: "
                                f"{error.strerror}") from None
        template = codecs.decode(value, "unicode_escape")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise DefaultsError(f"--chat-template: not a valid Jinja template: {error.message} (line {error.lineno})"
                            ) from None
    return template


def generation_defaults(mode: str, model_dir: str | None, overrides: dict | None) -> dict:
    """`--generation-config auto` (the model directory's generation_config.json), `vllm` (none), or a
    directory holding one; `overrides` (`--override-generation-config`) are laid over the result."""
    raw: dict = {}
    directory = model_dir if mode == "auto" else (None if mode == "vllm" else mode)
    if mode not in ("auto", "vllm") and not os.path.isdir(mode):
        raise DefaultsError(f"--generation-config {mode!r} is invalid: expected auto, vllm or a directory "
                            f"holding generation_config.json")
    if directory is not None:
        path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path) as handle:
                    raw = json.load(handle)
            except (OSError, json.JSONDecodeError) as error:
                raise DefaultsError(f"--generation-config: {path} is not readable JSON: {error}") from None
        elif mode != "auto":
            raise DefaultsError(f"--generation-config {mode!r}: {path} does not exist")
    raw = {**raw, **(overrides or {})}
    defaults = {}
    for key, param in GENERATION_CONFIG_KEYS.items():
        if raw.get(key) is not None:
            defaults[param] = raw[key]
    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if key in defaults and not isinstance(defaults[key], (int, float)):
            raise DefaultsError(f"generation config {key}={defaults[key]!r} is invalid: expected a number")
    for key in ("top_k", "max_tokens"):
        if key in defaults and not isinstance(defaults[key], int):
            raise DefaultsError(f"generation config {key}={defaults[key]!r} is invalid: expected an integer")
    return defaults
