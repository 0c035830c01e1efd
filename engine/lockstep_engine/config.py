"""`EngineConfig`: the one frozen configuration of an engine process, validated once.

Field names follow vLLM's engine arguments so a vLLM user's flags carry over.
No torch here: the scheduler and block manager read this too.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Literal, Union

MAX_SCHEDULER_STEPS = 64
# Prefill tokens per step by default (vLLM's default for its API server on large GPUs): served on one
# H200 at rate inf, 42.3-42.7 req/s against 39.9 with 2048 in the same call: fewer windows stop for a
# prefill step, each with a larger chunk (docs/BENCHMARKS.md, "Served, default flags").
DEFAULT_BATCHED_TOKENS = 8192
# A longer prompt computes at most this many tokens per step (`long_prefill_token_threshold`), so a
# stream decoding next to it waits one step of this many prompt tokens per token, not one step of the
# whole prompt. Measured on one H200 (random:llama-3-8b, streams at 10 req/s with 6000-token prompts at
# 0.6 req/s; docs/BENCHMARKS.md, "Long prompts among streams"): the streams' longest inter-token gap
# 61 ms at 1024, 80 ms at 1536, 115 ms at 2048, 207 ms uncapped; the long prompts' TTFT p50 236, 207,
# 199 and 178 ms. Sharegpt-shaped prompts (at most 1024 tokens) are never cut by it.
DEFAULT_LONG_PREFILL_TOKENS = 1024
AUTO = "auto"
# --attention-backend: auto picks per phase on the device (lockstep_engine.attention_backends); flash-attn
# needs the optional `flash-attn` extra. VLLM_ATTENTION_BACKENDS: vLLM's names for the same kernels
# (its VLLM_ATTENTION_BACKEND variable).
ATTENTION_BACKENDS = ("auto", "triton", "flash-attn", "torch")
VLLM_ATTENTION_BACKENDS = {"TRITON_ATTN": "triton", "FLASH_ATTN": "flash-attn", "TORCH_SDPA": "torch"}

SCHEDULING_POLICIES = ("fcfs", "lof", "priority")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
MAX_LORAS = 64
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # what `sources.resolve` reads (vLLM's names)


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field, the value and the range."""


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {allowed}")


def parse_num_scheduler_steps(value: Union[int, str]) -> Union[int, str]:
    """Accepts 1..64 or 'auto' (also as strings from the command line)."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(
                f"num_scheduler_steps={value!r} is invalid: expected an integer in [1, {MAX_SCHEDULER_STEPS}] or 'auto'"
            ) from None
    _require(
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SCHEDULER_STEPS,
        "num_scheduler_steps", value, f"an integer in [1, {MAX_SCHEDULER_STEPS}] or 'auto'",
    )
    return value


def num_scheduler_steps_arg(text: str) -> Union[int, str]:
    """argparse `type=` for `--num-scheduler-steps`; argparse puts the flag's name before the message."""
    try:
        return parse_num_scheduler_steps(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: expected an integer in [1, {MAX_SCHEDULER_STEPS}] or 'auto'"
        ) from None


def parse_layer_partition(value, pp_size: int) -> tuple[int, ...] | None:
    """`pipeline_layer_partition`: decoder layers per pipeline stage, as "19,11" or a sequence of
    counts; one count >= 1 per stage. None or "": the weight-balanced default (`parallel.stage_layers`)."""
    if value is None or value == "":
        return None
    allowed = f"{pp_size} comma-separated layer counts, each >= 1 (one per pipeline stage)"
    try:
        counts = tuple(int(x) for x in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise ConfigError(f"pipeline_layer_partition={value!r} is invalid: expected {allowed}") from None
    _require(len(counts) == pp_size and min(counts, default=0) >= 1, "pipeline_layer_partition", value, allowed)
    return counts


# ---- speculative decoding (vLLM's --speculative-config) ------------------------------------------
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's other methods: each needs weights or heads trained for the target, which no source here carries.
REFUSED_SPECULATIVE_METHODS = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "deepseek_mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "seed")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`: each step of a window proposes `num_speculative_tokens` tokens per row
    (n-gram prompt lookup, or a draft model) and the target verifies them in one forward."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's source (any model source of `sources.resolve`)
    prompt_lookup_max: int = 0  # ngram: the longest suffix looked up in the row's tokens
    prompt_lookup_min: int = 0  # ngram: the shortest
    # Lockstep's own key: the seed a `random:<shape>` draft's weights are drawn with. None: the engine's
    # seed, so `random:<shape>` drafting for the same `random:<shape>` target is the target itself.
    seed: int | None = None

    @property
    def is_ngram(self) -> bool:
        return self.method == "ngram"


def _field(name: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"speculative_config.{name}={value!r} is invalid: expected {allowed}")


def _spec_int(values: dict, name: str, low: int, high: int, default: int | None = None) -> int:
    value = values.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _field(name, value, f"an integer in [{low}, {high}]")
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """vLLM's JSON object (or the dict itself, or a `SpeculativeConfig`); None or "" when off. Errors
    name the field, the value and what is allowed."""
    if value is None or value == "" or isinstance(value, SpeculativeConfig):
        return value or None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(f"speculative_config={value!r} is invalid: expected a JSON object ({error})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config={value!r} is invalid: expected a JSON object")
    unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise _field(unknown[0], value[unknown[0]], "one of the keys " + ", ".join(_SPECULATIVE_KEYS))
    method = value.get("method")
    if method is None and value.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
        method = "ngram"
    if method in REFUSED_SPECULATIVE_METHODS:
        raise ConfigError(f"speculative_config.method={method!r} is not supported here: this engine drafts with "
                          f"{' or '.join(SPECULATIVE_METHODS)} only")
    if method not in SPECULATIVE_METHODS:
        raise _field("method", method, "one of " + ", ".join(SPECULATIVE_METHODS))
    k = _spec_int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if method == "draft_model":
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise _field("model", model, "the draft model's source (smollm2, random:<shape>, a .gguf file, "
                                         "a model directory or hub id)")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if name in value:
                raise _field(name, value[name], "no prompt_lookup_* with method 'draft_model'")
        seed = _spec_int(value, "seed", 0, 2**63 - 1) if "seed" in value else None
        return SpeculativeConfig(method, k, model=model, seed=seed)
    if "seed" in value:
        raise _field("seed", value["seed"], "no seed with method 'ngram' (it seeds a random draft model)")
    # vLLM's defaults: both 5 when neither is given, else the one given for the other
    high = _spec_int(value, "prompt_lookup_max", 1, 64, default=value.get("prompt_lookup_min", 5))
    low = _spec_int(value, "prompt_lookup_min", 1, high, default=high)
    return SpeculativeConfig(method, k, prompt_lookup_max=high, prompt_lookup_min=low)


def speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """argparse `type=` for `--speculative-config`."""
    try:
        return parse_speculative_config(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    num_scheduler_steps: Union[int, str] = 8
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's own context length
    # None: max(DEFAULT_BATCHED_TOKENS, max_num_seqs); a prompt longer than that is chunked over windows.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # vLLM's names: a prompt with more tokens left than the threshold is long and computes at most that
    # many per step (0: only max_num_batched_tokens chunks); at most max_long_partial_prefills long
    # prompts are partly computed at once. Together they bound what a decoding stream waits per token.
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKENS
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    # Order of admission from the queue: "fcfs" (arrival), or "lof" (longest output first: the largest
    # remaining max_tokens first, SGLang's --schedule-policy lof), which starts long requests early; the
    # default, since it measured fastest (docs/BENCHMARKS.md, run 6). A request without max_tokens counts
    # as long as max_model_len allows. Under lof a request that has waited lof_max_wait_s seconds goes
    # ahead of every fresh request that has not (by arrival), so short requests are never starved. Or
    # "priority" (vLLM's): the lowest request `priority` first, then arrival; preemption takes the last.
    scheduling_policy: Literal["fcfs", "lof", "priority"] = "lof"
    lof_max_wait_s: float = 2.0
    # A request that arrives while a window runs ends that window after the step in flight, so it is
    # admitted at the next step rather than after the window's last (time to first token stays close to
    # N=1's); a window that computes only part of a prompt ends after its first step, so the next chunk
    # runs a step later. Only where the engine runs its windows alone (one rank, no pipeline
    # micro-batches): the ranks of a group run the steps the plan they were sent says.
    arrival_cuts: bool = True
    # Overlap (vLLM's --async-scheduling): the next window is planned, prepared and launched while a
    # window's last step runs, from that step's tokens on the device. None: on where the device runs
    # ahead of the host (CUDA), off on the CPU. Only where one rank runs its windows alone.
    async_scheduling: bool | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None  # fixed KV cache size in blocks (tests, CPU)
    kv_cache_memory_bytes: int | None = None  # CPU default: 2 GiB
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int | None = None  # micro-batches in flight per window with PP; None: one per stage
    # Decoder layers per pipeline stage, e.g. "19,11" (vLLM: VLLM_PP_LAYER_PARTITION); None: balanced by
    # the weight each stage reads per step (`parallel.stage_layers`).
    pipeline_layer_partition: tuple[int, ...] | None = None
    attention_backend: Literal["auto", "triton", "flash-attn", "torch"] = "auto"  # ATTENTION_BACKENDS
    enforce_eager: bool = False
    # A window's first step when it carries prompt tokens, as CUDA graph replays over token buckets
    # (runner/prefill_graphs.py): auto where the warm-up measures a replay at most half the eager step's time.
    # Off by default until the graphs have run on a GPU (their tests there and a served figure).
    prefill_cuda_graphs: Literal["auto", "on", "off"] = "auto"
    # The server's engine core compiles kernels and captures graphs before it reports ready (`warmup`);
    # True skips that (faster start, slower first requests). The offline `LLM` never warms up.
    skip_warmup: bool = False
    max_logprobs: int = 20
    # Hugging Face hub ids (`org/name`) are read from the local cache: `download_dir` (vLLM's flag) or
    # HF_HOME, at `revision` (a branch, tag or commit; default main).
    download_dir: str | None = None
    revision: str | None = None
    load_format: Literal["auto", "safetensors", "gguf"] = "auto"
    # vLLM's --speculative-config (JSON, a dict or a `SpeculativeConfig`); None: no speculation
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (vLLM's flags): --lora-modules as (name, path) pairs, loaded at start; at most max_loras
    # of them in the model's weight slots at once (a batch mixes at most that many), of rank <= max_lora_rank;
    # at most max_cpu_loras registered (None: max(max_loras, the --lora-modules count)).
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(self, "num_scheduler_steps", parse_num_scheduler_steps(self.num_scheduler_steps))
        _require(isinstance(self.model, str) and bool(self.model), "model", self.model, "a model source")
        _require(1 <= self.max_num_seqs <= 65536, "max_num_seqs", self.max_num_seqs, "an integer in [1, 65536]")
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "max_model_len", self.max_model_len, "a positive integer")
        if self.max_num_batched_tokens is not None:
            _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens,
                     "a positive integer")
        _require(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold", self.long_prefill_token_threshold,
                 "an integer >= 0 (0: no cap per prompt and step)")
        _require(isinstance(self.max_long_partial_prefills, int) and self.max_long_partial_prefills >= 1,
                 "max_long_partial_prefills", self.max_long_partial_prefills, "an integer >= 1")
        _require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
                 "one of " + ", ".join(SCHEDULING_POLICIES))
        _require(isinstance(self.lof_max_wait_s, (int, float)) and not isinstance(self.lof_max_wait_s, bool)
                 and self.lof_max_wait_s >= 0, "lof_max_wait_s", self.lof_max_wait_s,
                 "seconds >= 0 (inf: no bound)")
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size", self.block_size, "one of 8, 16, 32, 64, 128")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", self.gpu_memory_utilization,
                 "a fraction in (0, 1]")
        if self.num_gpu_blocks_override is not None:
            _require(self.num_gpu_blocks_override >= 1, "num_gpu_blocks_override", self.num_gpu_blocks_override,
                     "a positive integer")
        _require(self.dtype in DTYPES, "dtype", self.dtype, "one of auto, half, float16, bfloat16, float, float32")
        _require(self.load_format in LOAD_FORMATS, "load_format", self.load_format, "one of " + ", ".join(LOAD_FORMATS))
        _require(self.device in ("auto", "cpu", "cuda"), "device", self.device, "one of auto, cpu, cuda")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1")
        _require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", self.pipeline_parallel_size,
                 "an integer >= 1")
        if self.pipeline_micro_batches is not None:
            _require(1 <= self.pipeline_micro_batches <= 64, "pipeline_micro_batches", self.pipeline_micro_batches,
                     "an integer in [1, 64]")
        object.__setattr__(self, "pipeline_layer_partition",
                           parse_layer_partition(self.pipeline_layer_partition, self.pipeline_parallel_size))
        _require(self.prefill_cuda_graphs in ("auto", "on", "off"), "prefill_cuda_graphs", self.prefill_cuda_graphs,
                 "one of auto, on, off")
        _require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", self.attention_backend,
                 "one of " + ", ".join(ATTENTION_BACKENDS))
        _require(0 <= self.max_logprobs <= 100, "max_logprobs", self.max_logprobs, "an integer in [0, 100]")
        spec = parse_speculative_config(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is not None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ConfigError(f"speculative_config is not supported with tensor_parallel_size="
                              f"{self.tensor_parallel_size} and pipeline_parallel_size={self.pipeline_parallel_size}: "
                              f"speculative windows run on one rank only")

        self._check_lora()

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_modules", tuple((str(n), str(p)) for n, p in self.lora_modules))
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules were given without enable_lora: start with --enable-lora")
        _require(isinstance(self.max_loras, int) and 1 <= self.max_loras <= MAX_LORAS, "max_loras", self.max_loras,
                 f"an integer in [1, {MAX_LORAS}]")
        _require(self.max_lora_rank in LORA_RANKS, "max_lora_rank", self.max_lora_rank,
                 "one of " + ", ".join(map(str, LORA_RANKS)))
        names = [name for name, _ in self.lora_modules]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        _require(duplicate is None, "lora_modules", duplicate, "each adapter name once")
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, len(names))
        _require(isinstance(cpu, int) and cpu >= max(self.max_loras, len(names)), "max_cpu_loras", cpu,
                 f"an integer >= max_loras ({self.max_loras}) and >= the {len(names)} --lora-modules")
        object.__setattr__(self, "max_cpu_loras", cpu)
        if self.enable_lora and self.speculative_config is not None:
            raise ConfigError("enable_lora is not supported with speculative_config: speculative windows run "
                              "without LoRA weights")

    @property
    def is_adaptive(self) -> bool:
        return self.num_scheduler_steps == AUTO

    def with_model_limits(self, model_max_len: int) -> "EngineConfig":
        """Resolves max_model_len / max_num_batched_tokens against the model's context length."""
        max_len = self.max_model_len or model_max_len
        _require(max_len <= model_max_len, "max_model_len", self.max_model_len,
                 f"at most the model's context length {model_max_len}")
        batched = self.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, self.max_num_seqs)
        if not self.enable_chunked_prefill:
            _require(batched >= max_len, "max_num_batched_tokens", batched,
                     f">= max_model_len ({max_len}) when chunked prefill is off")
        return replace(self, max_model_len=max_len, max_num_batched_tokens=batched)
