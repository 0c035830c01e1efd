"""Offline API in vLLM's style: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat(...)`."""

from __future__ import annotations

import sys
import time
from dataclasses import fields

from lockstep_engine.config import EngineConfig
from lockstep_engine.engine import LLMEngine
from lockstep_engine.outputs import RequestOutput
from lockstep_engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """Generates for a batch of prompts; keyword arguments are `EngineConfig` fields (vLLM's names)."""

    def __init__(self, model: str, share_model_with: "LLM | None" = None, **kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; expected any of {sorted(known)}")
        other = share_model_with.engine if share_model_with is not None else None
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), share_model_with=other)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """`lora_request`: a LoRA adapter for every prompt, or a list with one per prompt (None: the base model),
        each a registered adapter's name or, as vLLM's LoRARequest, anything with `lora_name` and `lora_path`
        (registered on first use)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompts)} prompts (expected one "
                             f"or one per prompt)")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts (expected one or one per prompt)")
        ids = [self.engine.add_request(_prompt_input(p), sp, lora_name=self.engine.lora_name(lora))
               for p, sp, lora in zip(prompts, params_list, loras)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv, add_generation_prompt) for conv in conversations]
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"messages: model {self.engine.config.model!r} has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=False))

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        started, total = time.monotonic(), len(request_ids)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    if use_tqdm:
                        print(f"\r[lockstep] {len(results)}/{total} requests "
                              f"({time.monotonic() - started:.1f}s)", end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        return [results[request_id] for request_id in request_ids]


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt
