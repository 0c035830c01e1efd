"""`LLMEngine`: model, engine core and output processing in one process (offline use and tests)."""

from __future__ import annotations

import itertools
import random
import time

from lockstep_engine.protocol import SequenceOutput, StepOutputs
from lockstep_engine.config import EngineConfig
from lockstep_engine.engine_core import EngineCore
from lockstep_engine.group.executor import load_engine
from lockstep_engine.output_processor import OutputProcessor, RequestState
from lockstep_engine.outputs import CompletionOutput, RequestOutput
from lockstep_engine.sampling_params import SamplingParams
from lockstep_engine.sequence import Request
from lockstep_engine.validation import validate_prompt, validate_request


class LLMEngine:
    def __init__(self, config: EngineConfig, share_model_with: "LLMEngine | None" = None):
        """`share_model_with` reuses another engine's loaded weights and KV cache memory (benchmarks
        and tests comparing window lengths); the other engine must be idle from then on."""
        if share_model_with is None:
            loaded = load_engine(config)
            self.tokenizer, self.config, self.model_config = loaded.tokenizer, loaded.config, loaded.model_config
            self.executor = loaded.executor
        else:
            other = share_model_with
            self.tokenizer, self.model_config, self.executor = other.tokenizer, other.model_config, other.executor
            self.executor.use_attention_backend(config.attention_backend)
            self.config = config.with_model_limits(other.model_config.max_position_embeddings)
        self.core = EngineCore(self.config, self.executor)
        self.processor = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids)
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._updated: dict[str, RequestState] = {}

    # ---- inputs -----------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt: model {self.config.model!r} has no tokenizer; send token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def validate_prompt(self, token_ids: list[int]) -> None:
        validate_prompt(self.config, self.model_config, token_ids)

    def lora_name(self, lora_request) -> str | None:
        """The adapter name of a `lora_request` (a name, or an object with lora_name and lora_path, as vLLM's
        LoRARequest, registered on first use); None for None."""
        if lora_request is None or isinstance(lora_request, str):
            return lora_request
        adapters = self.core.scheduler.adapters
        if adapters is not None and lora_request.lora_name not in adapters.registered:
            adapters.load(lora_request.lora_name, lora_request.lora_path, self.executor.runner.read_lora)
        return lora_request.lora_name

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, lora_name: str | None = None) -> str:
        """Validates and queues a request; raises SamplingParamsError naming the bad field."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_request(self.config, self.model_config, token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(request_id, token_ids, params, self.config.max_model_len, seed, prompt=text,
                          arrival_time=arrival_time or time.monotonic())
        if lora_name is not None:
            if self.core.scheduler.adapters is None:
                raise ValueError("lora_request: LoRA adapters are off in this engine: create it with enable_lora=True")
            request.adapter = self.core.scheduler.adapters.resolve(lora_name)
        self.core.add_request(request)
        self.processor.add_request(request_id, text, token_ids, params)
        return request_id

    def abort_request(self, request_id: str) -> None:
        for output in self.core.abort_request(request_id):
            self._apply(output)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    # ---- loop -------------------------------------------------------------------------------
    def _apply(self, output: SequenceOutput) -> None:
        try:
            state, stop = self.processor.process(output)
        except Exception:
            self.core.fail_request(output.request_id, "detokenizing its output")
            return
        if state is None:
            return
        if stop is not None:
            self.core.stop_sequence(output.request_id, output.index, stop)
        self._updated[output.request_id] = state

    def step(self, on_step=None) -> list[RequestOutput]:
        """Runs one window; returns the requests it changed. `on_step(outputs)` sees every step."""
        def emit(step: StepOutputs) -> None:
            outputs = list(step.all_outputs())
            for output in outputs:
                self._apply(output)
            if on_step is not None:
                on_step(outputs)

        self.core.step(emit)
        for failure in self.core.take_failures():
            state = self.processor.states.get(failure.request_id)
            if state is None:
                continue
            for seq in state.sequences:
                if not seq.finished:
                    seq.finish_reason = "error"  # vLLM's finish reason of a request the engine failed
            self._updated[failure.request_id] = state
        updated, self._updated = self._updated, {}
        results = []
        for request_id, state in updated.items():
            result = self._to_output(state)
            results.append(result)
            if result.finished:
                self.processor.remove(request_id)
        return results

    def _to_output(self, state: RequestState) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.text, list(s.token_ids),
                                    list(s.logprobs) if state.params.logprobs is not None else None,
                                    s.finish_reason, s.stop_reason) for s in state.sequences]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, state.finished,
                             num_cached_tokens=state.num_cached_tokens,
                             prompt_logprobs=state.prompt_logprobs_by_position())
