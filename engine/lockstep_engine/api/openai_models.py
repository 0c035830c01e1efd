"""Request and response bodies of the OpenAI-compatible API, as vLLM accepts them.

Fields carry types only; ranges are checked once, by `SamplingParams` and the engine's request
validation, so an out-of-range value gets the same message offline and over HTTP. Unknown fields
are accepted and ignored, as vLLM does (clients send `user`, `metadata`, ... freely).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


# ---- shared pieces --------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class JsonSchemaFormat(OpenAIModel):
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]  # OpenAI's values


class SamplingFields(OpenAIModel):
    """Parameters both endpoints share (OpenAI's and vLLM's extras)."""

    model: Optional[str] = None
    n: Optional[int] = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = 0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    skip_special_tokens: Optional[bool] = True
    include_stop_str_in_output: Optional[bool] = False
    # Structured outputs, vLLM's older and newer spellings (api/structured.py reads them).
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    priority: Optional[int] = 0
    return_tokens_as_token_ids: Optional[bool] = False
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    use_beam_search: Optional[bool] = False  # refused when true (api/extras.py)
    # vLLM's other extras: honoured (request_id) or refused with a value other than their default
    # (api/extras.py), never dropped in silence.
    request_id: Optional[str] = None
    length_penalty: Optional[float] = None
    logits_processors: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    cache_salt: Optional[Any] = None
    return_token_ids: Optional[Any] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: Optional[bool] = True


class ContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class ChatMessage(OpenAIModel):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # deprecated by OpenAI; max_completion_tokens wins
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True  # false: at most one tool call per answer
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[dict[str, str]]] = None  # rendered by the chat template as `documents`, as in vLLM
    reasoning_effort: Optional[ReasoningEffort] = None  # rendered by the chat template as `reasoning_effort`
    mm_processor_kwargs: Optional[Any] = None  # refused unless empty: text-only models


class TokenizeRequest(OpenAIModel):
    """Either `prompt` (completions form) or `messages` (chat form)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


# ---- responses (documentation of what the handlers return) ----------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's Logprob, one per token id in an entry of `prompt_logprobs`."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One entry per prompt token (None for the first): token id (as a string) -> its logprob
PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[PromptLogprobs] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lockstep"
    root: str
    parent: Optional[str] = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
