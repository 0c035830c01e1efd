"""Request handling behind the routes: OpenAI bodies -> engine requests -> responses and SSE streams.

Each HTTP request becomes one engine request per prompt (all with the same `SamplingParams`); its
text comes from the API process's output processor, so the engine loop only ever sees token ids.
Streams send one chunk per choice per engine step that brought it tokens, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse

from lockstep_common.max_tokens import requested_max_tokens
from lockstep_engine.protocol import TokenLogprobs
from lockstep_engine.api import extras, metrics, reasoning, structured, tools
from lockstep_engine.api.client import EngineBusyError, EngineCoreClient, EngineDeadError, Generation, RequestRejected
from lockstep_engine.api.sse import (SSE_DONE, SSE_HEADERS, ClientGone, EventStreamResponse, message_text, sse,
                                     take_delta, usage, watch_disconnect)
from lockstep_engine.api.errors import APIError, bad_request, error_body, refused_unstarted
from lockstep_engine.api.grammar_check import GrammarChecker
from lockstep_engine.api.large_text import LARGE_TEXT_CHARS, LargeTextEncoder
from lockstep_engine.api.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from lockstep_engine.api.server_defaults import ServerDefaults
from lockstep_engine.api.tokenize import inline_prompt
from lockstep_engine.sampling_params import SamplingParams, SamplingParamsError
from lockstep_engine.validation import MAX_PROMPTS, validate_batch, validate_messages, validate_request

@dataclass
class _Job:
    """What a handler needs to answer one HTTP request."""

    response_id: str
    created: int
    model: str
    n: int
    generation: Generation
    prompt_texts: list[str]  # for echo
    include_usage: bool
    num_logprobs: int | None  # None: no logprobs
    echo: bool = False
    chunk_object: str = "text_completion"
    sent_finish: set = field(default_factory=set)
    tool_call: tools.ToolCalling | None = None  # chat requests with tools
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    text_offsets: dict = field(default_factory=dict)  # streamed logprobs: (prompt, sample) -> next token's offset
    echoed: set = field(default_factory=set)
    render: Callable[[int], str] | None = None  # token names in logprobs (extras.token_renderer)
    reasoning: reasoning.ReasoningStream | None = None  # streamed chat with --reasoning-parser


class OpenAIServing:
    def __init__(self, client: EngineCoreClient, config, model_config, tokenizer, served_model_names: list[str],
                 idle_timeout_s: float):
        self.client = client
        self.config = config  # EngineConfig resolved against the model's limits
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.large_text = LargeTextEncoder(tokenizer) if LargeTextEncoder.supports(tokenizer) else None
        self.served_model_names = served_model_names
        self.idle_timeout_s = idle_timeout_s
        self._token_strs: dict[int, str] = {}
        self.tool_call_parser: str | None = None  # --tool-call-parser when --enable-auto-tool-choice
        self.reasoning_parser: str | None = None  # --reasoning-parser (api/reasoning.py)
        self.defaults = ServerDefaults()  # --chat-template, --response-role, --generation-config (set by the app)
        self.grammars = GrammarChecker()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(self.defaults.chat_template
                                                   or getattr(self.tokenizer, "chat_template", None))

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: a served name of the base model, or no name);
        404 naming it when it is neither."""
        if name is None or name in self.served_model_names:
            return None
        if name in self.client.adapters:
            return name
        available = ", ".join([*self.served_model_names, *self.client.adapters])
        raise APIError(404, f"The model `{name}` does not exist. Available: {available}.", "model")

    trust_request_chat_template = False  # --trust-request-chat-template

    def check_request_template(self, body) -> None:
        """A template sent with the request is code the server would run: refused unless trusted (as vLLM)."""
        if self.trust_request_chat_template:
            return
        if getattr(body, "chat_template", None) is not None:
            param = "chat_template"
        elif "chat_template" in (body.chat_template_kwargs or {}):
            param = "chat_template_kwargs"
        else:
            return
        raise bad_request(f"{param}: a chat template in the request is refused; start the server with "
                          f"--trust-request-chat-template to allow it", param)

    def request_template_kwargs(self, body) -> dict:
        """What the chat template renders with: vLLM's top-level `chat_template` (refused unless trusted),
        then `chat_template_kwargs` and the tools, which win over it as in vLLM."""
        self.check_request_template(body)
        template = getattr(body, "chat_template", None)
        if template is None:
            return tools.template_kwargs(body)
        if not isinstance(template, str) or not template:
            raise bad_request(f"chat_template: expected a non-empty Jinja template string, got "
                              f"{type(template).__name__}", "chat_template")
        return {"chat_template": template, **tools.template_kwargs(body)}

    # ---- inputs -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise bad_request(f"{param}: model {self.model_name!r} has no tokenizer; send token ids instead of text",
                              param)
        if len(text) < LARGE_TEXT_CHARS or self.large_text is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return self.large_text.encode_prompt(text, add_special_tokens, self.config, self.model_config, param)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._token_strs[token_id] = text
        return text

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                    template_kwargs: dict | None) -> list[int]:
        if not self.has_chat_template:
            raise bad_request(f"messages: model {self.model_name!r} has no chat template; use /v1/completions",
                              "messages")
        if not messages:
            raise bad_request("messages: expected at least one message", "messages")
        try:
            validate_messages(len(messages))
        except SamplingParamsError as error:
            raise bad_request(str(error), error.param) from None
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        conversation = [tools.template_message(m, message_text(m, i), i) for i, m in enumerate(messages)]
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(continue_final_message), tokenize=True, return_dict=False,
                **{"chat_template": self.defaults.chat_template, **self.defaults.chat_template_kwargs,
                   **(template_kwargs or {})})
        except TemplateError as error:  # jinja2's errors and a template's raise_exception() calls
            raise bad_request(f"messages: the chat template failed: {error}", "messages") from None
        except Exception as error:  # the tokenizer's own text is no message for a client
            raise bad_request(f"messages: the rendered conversation could not be tokenized "
                              f"({type(error).__name__})", "messages") from None
        return list(ids)

    def guided_constraint(self, body: SamplingFields) -> tuple[str, dict] | None:
        """The request's structured-output constraint (its field, its spec), not compiled yet: `grammars.check`."""
        return structured.guided_constraint(body, self.json_schema(body), self.client.ready)

    def sampling_params(self, body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        constraint: tuple[str, dict] | None) -> SamplingParams:
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        extras.check(body, self.config)
        logit_bias = None
        if body.logit_bias:
            try:
                logit_bias = {int(token): bias for token, bias in body.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias: keys must be token ids (integers as strings)", "logit_bias") from None
        fields = dict(
            n=1 if body.n is None else body.n,
            temperature=self.defaults.value("temperature", body.temperature, 1.0),
            top_p=self.defaults.value("top_p", body.top_p, 1.0),
            top_k=self.defaults.value("top_k", body.top_k, 0),
            min_p=self.defaults.value("min_p", body.min_p, 0.0),
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            max_tokens=self.defaults.max_tokens(max_tokens),
            min_tokens=body.min_tokens or 0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=self.defaults.value("repetition_penalty", body.repetition_penalty, 1.0),
            logprobs=logprobs,
            prompt_logprobs=extras.prompt_logprobs(body),
            ignore_eos=bool(body.ignore_eos),
            logit_bias=logit_bias,
            skip_special_tokens=body.skip_special_tokens is not False,
            include_stop_str_in_output=bool(body.include_stop_str_in_output), priority=body.priority or 0,
            guided=None if constraint is None else constraint[1], **extras.sampling_extras(body, self),
        )
        try:
            return SamplingParams(**fields)
        except SamplingParamsError as error:
            raise bad_request(str(error), error.param) from None

    def json_schema(self, body: SamplingFields) -> dict | None:
        fmt = body.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            schema = {"type": "object"}
        elif fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format: type 'json_schema' needs json_schema.schema", "response_format")
        else:
            schema = tools.response_schema(fmt.json_schema)
        ready = self.client.ready
        if ready is not None and not ready.guided_decoding:
            raise bad_request(f"response_format: model {self.model_name!r} has no tokenizer for guided decoding "
                              f"(or llguidance is not installed)", "response_format")
        return schema

    def validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        extras.truncate_prompts(prompts, params.truncate_prompt_tokens, self.config.max_model_len)
        try:
            validate_batch(len(prompts), params.n)
            for ids in prompts:
                validate_request(self.config, self.model_config, ids, params)
        except SamplingParamsError as error:
            raise bad_request(str(error), error.param) from None

    def submit(self, kind: str, prompts: list[list[int]], texts: list[str | None], params: SamplingParams,
               client_request_id: str | None = None, lora_name: str | None = None) -> tuple[str, Generation]:
        """The response's id is vLLM's `{kind}-{request_id}` when the client names one; the engine's own ids
        stay unique, so two requests that send the same `request_id` never meet in the engine."""
        internal_id = f"{kind}-{uuid.uuid4().hex}"
        response_id = internal_id if client_request_id is None else f"{kind}-{client_request_id}"
        request_ids = [f"{internal_id}-{i}" for i in range(len(prompts))]
        try:
            return response_id, self.client.submit(request_ids, prompts, params, texts, lora_name)
        except EngineBusyError as error:
            raise refused_unstarted(str(error), retry_after=True) from None
        except EngineDeadError as error:
            raise refused_unstarted(str(error)) from None

    # ---- /v1/completions ----------------------------------------------------------------------
    def completion_prompts(self, body: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items or any(len(item) == 0 for item in items):
            raise bad_request("prompt: expected a non-empty string, list of strings, token ids or lists of token ids",
                              "prompt")
        if len(items) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
        add_special = body.add_special_tokens is not False
        ids = [self.encode(item, add_special) if isinstance(item, str) else list(item) for item in items]
        texts = [item if isinstance(item, str) else None for item in items]
        return ids, texts

    async def create_completion(self, body: CompletionRequest, request: Request):
        lora_name = self.check_model(body.model)
        if body.suffix:
            raise bad_request("suffix: fill-in-the-middle is not supported", "suffix")
        if body.best_of is not None and body.best_of > 1:
            raise bad_request("best_of: only best_of=1 is supported", "best_of")
        # Tokenizing a large prompt takes seconds: off the event loop, so /health and streams go on. Token ids
        # and short texts stay on it: the hop to a worker thread costs the loop more than they do.
        if inline_prompt(body.prompt):
            prompts, texts = self.completion_prompts(body)
        else:
            prompts, texts = await asyncio.to_thread(self.completion_prompts, body)
        constraint = self.guided_constraint(body)
        params = self.sampling_params(body, body.max_tokens, body.logprobs, constraint)
        self.validate(prompts, params)
        await self.grammars.check(constraint)
        response_id, generation = self.submit("cmpl", prompts, texts, params, body.request_id, lora_name)
        job = _Job(response_id, int(time.time()), body.model or self.model_name, params.n, generation,
                   [t if t is not None else self.decode(ids) for t, ids in zip(texts, prompts)] if body.echo else [],
                   bool(body.stream_options and body.stream_options.include_usage), params.logprobs, bool(body.echo))
        job.continuous_usage, job.render = extras.continuous_usage(body), extras.token_renderer(body, self.token_str)
        if body.stream:
            return EventStreamResponse(self._stream(job, self._completion_chunks), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        await self._wait_finished(job, request)
        choices = []
        for p_index, state in enumerate(generation.states):
            for seq in state.sequences:
                text = (job.prompt_texts[p_index] if job.echo else "") + seq.text
                entries = extras.echoed(state, seq.logprobs) if job.echo else seq.logprobs
                logprobs = self._completion_logprobs(entries, 0, job.render) if job.num_logprobs is not None else None
                choices.append({"index": p_index * job.n + seq.index, "text": text, "logprobs": logprobs,
                                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                                "prompt_logprobs": extras.prompt_logprobs_field(state, self.token_str)})
        return JSONResponse({"id": response_id, "object": "text_completion", "created": job.created,
                             "model": job.model, "choices": choices, "usage": usage(generation)})

    def _completion_chunks(self, job: _Job) -> list[dict]:
        chunks = []
        for p_index, state in enumerate(job.generation.states):
            for seq in state.sequences:
                key = (p_index, seq.index)
                delta, new_logprobs, finishing = take_delta(job, key, seq)
                if delta is None:
                    continue
                text = delta
                if job.echo and key not in job.echoed:
                    job.echoed.add(key)
                    text = job.prompt_texts[p_index] + text
                    new_logprobs = extras.echoed(state, new_logprobs)
                logprobs = None
                if job.num_logprobs is not None:
                    # Each token's start offset, as non-streamed responses give it.
                    logprobs = self._completion_logprobs(new_logprobs, job.text_offsets.get(key, 0), job.render)
                    job.text_offsets[key] = job.text_offsets.get(key, 0) + sum(map(len, logprobs["tokens"]))
                chunks.append({"id": job.response_id, "object": "text_completion", "created": job.created,
                               "model": job.model,
                               "choices": [{"index": p_index * job.n + seq.index, "text": text, "logprobs": logprobs,
                                            "finish_reason": seq.finish_reason if finishing else None,
                                            "stop_reason": seq.stop_reason if finishing else None}]})
        return chunks

    def _completion_logprobs(self, entries: list[TokenLogprobs], text_offset: int, render) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = render(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            # The token first, as vLLM orders them; None: an echoed first prompt token (extras.echoed)
            top = None if entry.top is None else {text: entry.logprob} | {render(t): lp for t, lp in entry.top}
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        lora_name = self.check_model(body.model)
        tool_call = tools.ToolCalling.of(body, self.tool_call_parser)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        prompt = await asyncio.to_thread(self.chat_prompt, body.messages, body.add_generation_prompt is not False,
                                         bool(body.continue_final_message), self.request_template_kwargs(body))
        max_tokens = requested_max_tokens(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        constraint = self.guided_constraint(body)
        params = self.sampling_params(body, max_tokens, logprobs, constraint)
        self.validate([prompt], params)
        await self.grammars.check(constraint)
        response_id, generation = self.submit("chatcmpl", [prompt], [None], params, body.request_id, lora_name)
        job = _Job(response_id, int(time.time()), body.model or self.model_name, params.n, generation, [],
                   bool(body.stream_options and body.stream_options.include_usage), params.logprobs,
                   chunk_object="chat.completion.chunk", tool_call=tool_call)
        job.continuous_usage, job.render = extras.continuous_usage(body), extras.token_renderer(body, self.token_str)
        if self.reasoning_parser is not None:
            job.reasoning = reasoning.ReasoningStream(self.reasoning_parser)
        if body.stream:
            return EventStreamResponse(self._stream(job, self._chat_chunks, self._chat_role_chunks(job)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        await self._wait_finished(job, request)
        choices = []
        for seq in generation.states[0].sequences:
            logprobs = {"content": self._chat_logprobs(seq.logprobs, job)} if job.num_logprobs is not None else None
            message, finish_reason = reasoning.chat_message(self.reasoning_parser, tool_call, seq.text,
                                                            seq.finish_reason, tools.message)
            message["role"] = self.defaults.response_role
            choices.append({"index": seq.index, "message": message,
                            "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": seq.stop_reason})
        return JSONResponse({"id": response_id, "object": "chat.completion", "created": job.created,
                             "model": job.model, "choices": choices, "usage": usage(generation),
                             "prompt_logprobs": extras.prompt_logprobs_field(generation.states[0], self.token_str)})

    def _chat_chunk(self, job: _Job, index: int, delta: dict, logprobs=None, finish_reason=None,
                    stop_reason=None) -> dict:
        return {"id": job.response_id, "object": "chat.completion.chunk", "created": job.created,
                "model": job.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                             "stop_reason": stop_reason}]}

    def _chat_role_chunks(self, job: _Job) -> list[dict]:
        return [self._chat_chunk(job, i, {"role": self.defaults.response_role, "content": ""}) for i in range(job.n)]

    def _chat_chunks(self, job: _Job) -> list[dict]:
        chunks = []
        for seq in job.generation.states[0].sequences:
            delta, new_logprobs, finishing = take_delta(job, (0, seq.index), seq)
            if delta is None:
                continue
            logprobs = {"content": self._chat_logprobs(new_logprobs, job)} if job.num_logprobs is not None else None
            message, finish_reason = reasoning.chat_delta(job.reasoning, job.tool_call, seq.index, seq.releasable_text(),
                                                          delta, finishing, seq.finish_reason if finishing else None,
                                                          tools.stream_delta)
            if message is None:
                continue
            chunks.append(self._chat_chunk(job, seq.index, message, logprobs, finish_reason,
                                           seq.stop_reason if finishing else None))
        return chunks

    def _chat_logprobs(self, entries: list[TokenLogprobs], job: _Job) -> list[dict]:
        content = []
        for entry in entries:
            text = job.render(entry.token_id)
            top = [{"token": job.render(token), "logprob": logprob,
                    "bytes": list(job.render(token).encode("utf-8"))} for token, logprob in entry.top]
            content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8")),
                            "top_logprobs": top})
        return content

    # ---- shared streaming and waiting ---------------------------------------------------------
    async def _stream(self, job: _Job, make_chunks, first_chunks: list[dict] | None = None) -> AsyncIterator[str]:
        generation = job.generation
        completed = False
        try:
            if first_chunks:
                if job.continuous_usage:  # the first chunk too, as vLLM sends it (no tokens generated yet)
                    for chunk in first_chunks:
                        chunk["usage"] = usage(generation)
                yield "".join(sse(chunk) for chunk in first_chunks)
            while True:
                chunks = make_chunks(job)
                if chunks:
                    if job.continuous_usage:
                        for chunk in chunks:
                            chunk["usage"] = usage(generation)
                    payload = "".join(sse(chunk) for chunk in chunks)
                    metrics.observe_stream_delay(time.monotonic() - generation.last_emitted_at)
                    yield payload
                if generation.finished:
                    break
                await generation.next_update(self.idle_timeout_s)
            completed = True
            tail = ""
            if job.include_usage:
                tail = sse({"id": job.response_id, "object": job.chunk_object, "created": job.created,
                             "model": job.model, "choices": [], "usage": usage(generation)})
            yield tail + SSE_DONE
        except RequestRejected as error:
            completed = True
            yield sse(error_body(400, str(error), error.param)) + SSE_DONE
        except EngineDeadError as error:
            completed = True
            yield sse(error_body(503, str(error))) + SSE_DONE
        except RuntimeError as error:
            completed = True
            yield sse(error_body(500, str(error))) + SSE_DONE
        finally:
            # A client that went away mid-stream lands here via cancellation: free its blocks.
            if completed and generation.finished:
                self.client.release(generation)
            else:
                self.client.abort(generation)

    async def _wait_finished(self, job: _Job, request: Request) -> None:
        generation = job.generation
        watcher = asyncio.create_task(watch_disconnect(request, generation))
        try:
            while not generation.finished:
                await generation.wait(self.idle_timeout_s)
        except asyncio.TimeoutError:
            self.client.abort(generation)
            raise APIError(503, f"no output from the engine for {self.idle_timeout_s:.0f} s") from None
        except RequestRejected as error:
            raise bad_request(str(error), error.param) from None
        except EngineDeadError as error:
            raise APIError(503, str(error)) from None
        except RuntimeError as error:
            raise APIError(500, str(error)) from None
        except ClientGone:
            self.client.abort(generation)
            raise APIError(400, "the client disconnected before the response was ready") from None
        finally:
            watcher.cancel()
        self.client.release(generation)
