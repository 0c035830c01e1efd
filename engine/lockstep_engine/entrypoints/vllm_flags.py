"""The `vllm serve` flag catalogue: every flag of vLLM's common set, and what `lockstep serve` does with it.

Three answers, one per flag (docs/API.md prints the same table, and a test holds the two together):
* supported: `serve.build_parser` defines the flag and it acts as in vLLM;
* accepted without effect: the flag parses and a one-line notice says why it changes nothing here;
* refused: the flag parses, then `lockstep serve` exits 2 with a message that says why.
A refused or no-effect flag given a value in `accepted` (vLLM's default, or what this engine does
anyway) passes silently, so a config written for vLLM with defaults spelled out still starts.

The flag names and value syntaxes are vLLM's (vllm/engine/arg_utils.py and
vllm/entrypoints/openai/cli_args.py, v0.11); nothing here imports vLLM or torch.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lockstep_engine.config import speculative_config_arg
from lockstep_engine.entrypoints.cli_values import human_readable_int, json_list, json_object, lora_module

if TYPE_CHECKING:
    from lockstep_engine.api.server_defaults import ServerDefaults

SUPPORTED = "supported"
NO_EFFECT = "accepted without effect"
REFUSED = "refused"
STATUSES = (SUPPORTED, NO_EFFECT, REFUSED)


@dataclass(frozen=True)
class Flag:
    name: str  # the long option, e.g. "--trust-remote-code"
    status: str
    note: str  # supported: what it does here; otherwise why it has no effect or is refused
    kind: str = "value"  # how an unsupported flag parses: value | values | bool | bool_optional
    accepted: tuple[str, ...] = ()  # values that pass silently (str() of the parsed value)
    aliases: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


_TEXT_ONLY = "only text-only Llama-family decoders are served (no multimodal inputs)"
_ONE_ENGINE = "one engine per server; scale out with replicas behind the gateway"
_NO_MOE = "no mixture-of-experts models are served"


def _s(name: str, note: str, *aliases: str) -> Flag:
    return Flag(name, SUPPORTED, note, aliases=aliases)


def _n(name: str, note: str, kind: str = "value", accepted: tuple[str, ...] = ()) -> Flag:
    return Flag(name, NO_EFFECT, note, kind, accepted)


def _r(name: str, note: str, kind: str = "value", accepted: tuple[str, ...] = (), aliases: tuple[str, ...] = ()
       ) -> Flag:
    return Flag(name, REFUSED, note, kind, accepted, aliases)


FLAGS: tuple[Flag, ...] = (
    # ---- frontend (cli_args.py) -------------------------------------------------------------
    _s("--config", "YAML file of flags (keys are flag names without --); flags on the command line win"),
    _s("--host", "listen address"),
    _s("--port", "listen port"),
    _s("--uds", "listen on a Unix domain socket instead of host:port"),
    _s("--uvicorn-log-level", "uvicorn's log level; info and below add an access log"),
    _s("--disable-uvicorn-access-log", "no access log whatever the log level"),
    _s("--allow-credentials", "CORS: allow credentials"),
    _s("--allowed-origins", "CORS: allowed origins, a JSON list (CORS is on when any CORS flag is given)"),
    _s("--allowed-methods", "CORS: allowed methods, a JSON list"),
    _s("--allowed-headers", "CORS: allowed headers, a JSON list"),
    _s("--api-key", "require `Authorization: Bearer KEY` on /v1"),
    _s("--ssl-keyfile", "TLS private key (PEM); with --ssl-certfile the server speaks HTTPS"),
    _s("--ssl-certfile", "TLS certificate chain (PEM)"),
    _s("--ssl-ca-certs", "CA bundle for verifying client certificates"),
    _s("--ssl-cert-reqs", "client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)"),
    _s("--ssl-ciphers", "TLS 1.2 cipher suites"),
    _r("--enable-ssl-refresh", "certificates are read once at start; restart the server to rotate them", "bool"),
    _s("--root-path", "FastAPI root_path, for a path-prefix proxy in front"),
    _r("--middleware", "ASGI middleware is not imported by name; put a proxy in front", "values"),
    _s("--served-model-name", "names clients use in `model`; the first is reported"),
    _s("--chat-template", "a Jinja chat template, as a file path or the template itself"),
    _s("--chat-template-content-format", "auto or string: text parts are joined into a string (openai is refused)"),
    _s("--response-role", "the role of generated chat messages (default assistant)"),
    _s("--default-chat-template-kwargs", "JSON object merged under each request's chat_template_kwargs"),
    _s("--trust-request-chat-template", "allow a request's own chat_template"),
    _s("--enable-auto-tool-choice", "allow tool_choice auto (needs --tool-call-parser)"),
    _s("--tool-call-parser", "hermes, llama3_json or pythonic"),
    _r("--tool-parser-plugin", "tool-call parsers are built in (hermes, llama3_json, pythonic); no plugins"),
    _r("--tool-server", "no built-in tool servers (the Responses API is stateless here)"),
    _n("--exclude-tools-when-tool-choice-none", "tools are always rendered into the prompt as the template does",
       "bool"),
    _s("--lora-modules", "LoRA adapters loaded at start: name=path or vLLM's JSON object"),
    _r("--return-tokens-as-token-ids", "not implemented as a server-wide default", "bool"),
    _n("--disable-frontend-multiprocessing", "the API server and the engine core are always separate processes",
       "bool"),
    _n("--enable-request-id-headers", "responses carry no X-Request-Id header", "bool"),
    _n("--log-config-file", "logging is not configurable from a file; the server logs to stderr"),
    _n("--max-log-len", "prompts are never logged"),
    _s("--disable-fastapi-docs", "no /docs, /redoc or /openapi.json"),
    _n("--enable-prompt-tokens-details", "usage carries no prompt_tokens_details", "bool"),
    _n("--enable-server-load-tracking", "no /load endpoint; /metrics has the queue and running gauges", "bool"),
    _n("--enable-force-include-usage", "usage is sent when stream_options.include_usage asks for it", "bool"),
    _r("--enable-tokenizer-info-endpoint", "no /tokenizer_info endpoint", "bool"),
    _n("--enable-log-outputs", "outputs are never logged", "bool"),
    _n("--log-error-stack", "error responses are logged as one line", "bool"),
    _s("--h11-max-incomplete-event-size", "uvicorn's h11 limit on an incomplete header or body event"),
    _n("--h11-max-header-count", "uvicorn's h11 has no header-count limit to set"),
    _r("--headless", _ONE_ENGINE, "bool"),
    _s("--api-server-count", "API-server processes on the one port, feeding the one engine core"),
    _s("--stream-interval", "a request's tokens per streamed chunk; the first token goes at once"),
    _r("--grpc", "only the HTTP OpenAI-compatible server", "bool"),
    _n("--enable-log-requests", "requests are never logged", "bool_optional", ("False",)),
    _n("--disable-log-requests", "requests are never logged", "bool_optional", ("True",)),
    _n("--disable-log-stats", "no periodic stats log is written; /metrics is unaffected", "bool"),
    # ---- model (ModelConfig) ----------------------------------------------------------------
    _s("--model", "smollm2, random:<shape>, a .gguf file, a Hugging Face directory or hub id"),
    _r("--runner", "only generation is served", accepted=("auto", "generate")),
    _r("--convert", "models are served as they are (no pooling or classification conversion)",
       accepted=("auto", "none")),
    _r("--task", "only text generation is served", accepted=("auto", "generate")),
    _s("--tokenizer", "the tokenizer's directory or hub id (default: the model's)"),
    _s("--tokenizer-mode", "auto or hf (the fast Hugging Face tokenizer); slow, mistral and custom are refused"),
    _n("--trust-remote-code", "no model code is ever loaded: the Llama-family architectures are built in", "bool"),
    _s("--dtype", "auto, half, float16, bfloat16, float, float32"),
    _s("--seed", "the engine's random seed (random: weights, requests without a seed)"),
    _r("--hf-config-path", "the config is read from the model directory"),
    _r("--allowed-local-media-path", _TEXT_ONLY),
    _r("--allowed-media-domains", _TEXT_ONLY, "values"),
    _s("--revision", "hub ids: the branch, tag or commit of the cached snapshot (default main)"),
    _n("--code-revision", "no model code is ever loaded"),
    _r("--rope-scaling", "rope scaling is taken from the model's config"),
    _r("--rope-theta", "rope theta is taken from the model's config"),
    _n("--tokenizer-revision", "the tokenizer is read from the same snapshot as the model"),
    _s("--max-model-len", "the context length; vLLM's syntax: 32k = 32000, 32K = 32768, 1m, 1M"),
    _r("--quantization", "quantized checkpoints are not loaded (GGUF weights are dequantized when loaded)",
       aliases=("-q",), accepted=("None", "gguf")),
    _s("--enforce-eager", "no CUDA graphs"),
    _s("--max-logprobs", "the largest logprobs / top_logprobs a request may ask for"),
    _r("--logprobs-mode", "logprobs are always the raw log-softmax of the logits", accepted=("raw_logprobs",)),
    _n("--disable-sliding-window", "sliding-window models are refused at load", "bool"),
    _n("--disable-cascade-attn", "there is no cascade attention", "bool"),
    _r("--skip-tokenizer-init", "the tokenizer is needed for text and stop strings; models without one take "
       "token ids already", "bool"),
    _r("--enable-prompt-embeds", "prompts are text or token ids", "bool"),
    _n("--config-format", "the model config is read in Hugging Face's format", accepted=("auto", "hf")),
    _n("--hf-token", "nothing is downloaded: hub ids are read from the local cache"),
    _r("--hf-overrides", "the model's config is used as it is"),
    _r("--pooler-config", "no pooling models"),
    _r("--override-pooler-config", "no pooling models"),
    _r("--logits-processor-pattern", "no custom logits processors"),
    _r("--logits-processors", "no custom logits processors", "values"),
    _s("--generation-config", "auto (the model's generation_config.json), vllm (none), or a directory"),
    _s("--override-generation-config", "JSON object over the generation config's sampling defaults"),
    _r("--enable-sleep-mode", "no sleep mode", "bool"),
    _r("--model-impl", "the built-in implementation is the only one", accepted=("auto", "vllm")),
    _r("--override-attention-dtype", "attention runs in the model's dtype"),
    _r("--io-processor-plugin", "no IO processor plugins"),
    _n("--max-seq-len-to-capture", "decode CUDA graphs are captured per batch bucket, for any length"),
    # ---- loading (LoadConfig) ---------------------------------------------------------------
    _s("--load-format", "auto, safetensors or gguf; other formats are refused"),
    _s("--download-dir", "the Hugging Face cache that hub ids are read from (default HF_HOME's)"),
    _n("--safetensors-load-strategy", "safetensors files are read tensor by tensor"),
    _r("--model-loader-extra-config", "the loader takes no options"),
    _n("--ignore-patterns", "only *.safetensors (or the .gguf file) is read", "values"),
    _n("--use-tqdm-on-load", "loading prints one progress line", "bool_optional"),
    _n("--pt-load-map-location", "PyTorch .bin checkpoints are not read"),
    # ---- structured outputs -----------------------------------------------------------------
    _n("--guided-decoding-backend", "structured outputs always use llguidance"),
    _n("--structured-outputs-config", "structured outputs always use llguidance"),
    _s("--reasoning-parser", "deepseek_r1 or qwen3: <think> text as reasoning_content, reasoning items and "
                             "thinking blocks"),
    # ---- parallelism (ParallelConfig) -------------------------------------------------------
    _n("--distributed-executor-backend", "workers are local processes (torch.distributed), no Ray",
       accepted=("mp",)),
    _s("--pipeline-parallel-size", "pipeline stages of the engine's group", "-pp"),
    _s("--tensor-parallel-size", "tensor-parallel ranks of the engine's group", "-tp"),
    _r("--decode-context-parallel-size", "no decode context parallelism", aliases=("-dcp",), accepted=("1",)),
    _r("--data-parallel-size", _ONE_ENGINE, aliases=("-dp",), accepted=("1",)),
    _r("--data-parallel-rank", _ONE_ENGINE, aliases=("-dpn",)),
    _r("--data-parallel-start-rank", _ONE_ENGINE, aliases=("-dpr",)),
    _r("--data-parallel-size-local", _ONE_ENGINE, aliases=("-dpl",), accepted=("1",)),
    _r("--data-parallel-address", _ONE_ENGINE, aliases=("-dpa",)),
    _r("--data-parallel-rpc-port", _ONE_ENGINE, aliases=("-dpp",)),
    _r("--data-parallel-backend", _ONE_ENGINE, aliases=("-dpb",)),
    _r("--data-parallel-hybrid-lb", _ONE_ENGINE, "bool"),
    _r("--enable-expert-parallel", _NO_MOE, "bool"),
    _r("--enable-eplb", _NO_MOE, "bool"),
    _r("--enable-dbo", "no dual-batch overlap", "bool"),
    _n("--max-parallel-loading-workers", "each rank loads its own shard"),
    _r("--ray-workers-use-nsight", "no Ray workers", "bool"),
    _n("--disable-custom-all-reduce", "all-reduce is torch.distributed's (NCCL or gloo)", "bool"),
    _r("--worker-cls", "the worker is built in", accepted=("auto",)),
    _r("--worker-extension-cls", "no worker extensions"),
    # ---- KV cache (CacheConfig) -------------------------------------------------------------
    _s("--block-size", "KV-cache block size in tokens: 8, 16, 32, 64, 128"),
    _s("--gpu-memory-utilization", "fraction of device memory for weights, activations and the KV cache"),
    _s("--kv-cache-memory-bytes", "KV-cache size in bytes (vLLM's syntax: 4G = 4 GiB, 4g = 4e9)"),
    _n("--swap-space", "preempted sequences are recomputed, never swapped to host memory"),
    _r("--kv-cache-dtype", "the KV cache is kept in the model's dtype (no fp8 KV cache)", accepted=("auto",)),
    _s("--num-gpu-blocks-override", "a fixed KV-cache size in blocks"),
    _s("--enable-prefix-caching", "prefix caching (default on; --no-enable-prefix-caching turns it off)"),
    _n("--prefix-caching-hash-algo", "blocks are keyed by their token ids (Python's hash of the tuple chain)"),
    _r("--cpu-offload-gb", "no weight offloading to host memory", accepted=("0", "0.0")),
    _n("--calculate-kv-scales", "there is no fp8 KV cache to scale", "bool"),
    _n("--kv-sharing-fast-prefill", "no cross-layer KV sharing", "bool"),
    _n("--mamba-cache-dtype", "no Mamba models"),
    # ---- multimodal -------------------------------------------------------------------------
    _r("--limit-mm-per-prompt", _TEXT_ONLY),
    _r("--media-io-kwargs", _TEXT_ONLY),
    _r("--mm-processor-kwargs", _TEXT_ONLY),
    _r("--mm-processor-cache-gb", _TEXT_ONLY),
    _n("--disable-mm-preprocessor-cache", _TEXT_ONLY, "bool"),
    _r("--mm-encoder-tp-mode", _TEXT_ONLY),
    _r("--interleave-mm-strings", _TEXT_ONLY, "bool"),
    _n("--skip-mm-profiling", _TEXT_ONLY, "bool"),
    # ---- LoRA -------------------------------------------------------------------------------
    _s("--enable-lora", "LoRA adapters (PEFT), several in one batch"),
    _r("--enable-lora-bias", "LoRA adapters without bias only", "bool"),
    _s("--max-loras", "adapters in the model's weight slots at once (default 1)"),
    _s("--max-lora-rank", "the largest adapter rank (default 16)"),
    _n("--lora-extra-vocab-size", "adapters add no vocabulary", accepted=("256",)),
    _r("--lora-dtype", "adapter weights take the model's dtype", accepted=("auto",)),
    _s("--max-cpu-loras", "adapters registered at once (default: max-loras, or the --lora-modules count)"),
    _n("--fully-sharded-loras", "with tensor parallelism the B (column-parallel) or A (row-parallel) matrices "
                                "are sharded like the base weight", "bool"),
    _r("--default-mm-loras", _TEXT_ONLY),
    # ---- observability ----------------------------------------------------------------------
    _n("--show-hidden-metrics-for-version", "the deprecated vllm:time_per_output_token_seconds is still exported"),
    _r("--otlp-traces-endpoint", "no OpenTelemetry tracing; /metrics has the request-phase histograms"),
    _r("--collect-detailed-traces", "no OpenTelemetry tracing"),
    # ---- scheduler (SchedulerConfig) --------------------------------------------------------
    _s("--max-num-batched-tokens", "tokens per forward (vLLM's syntax: 8k, 8K)"),
    _s("--max-num-seqs", "sequences in the running batch"),
    _r("--max-num-partial-prefills", "one prompt is prefilled in chunks at a time", accepted=("1",)),
    _s("--max-long-partial-prefills", "long prompts (over --long-prefill-token-threshold) partly computed at once"),
    _s("--long-prefill-token-threshold", "a longer prompt computes at most this many tokens per step (default 1024; "
                                         "0: no cap)"),
    _n("--num-lookahead-slots", "KV slots for a whole window are reserved by the scheduler", accepted=("0",)),
    _s("--scheduling-policy", "fcfs, priority (the request's priority field) or lof (longest output first)"),
    _s("--enable-chunked-prefill", "chunked prefill (default on)"),
    _n("--disable-chunked-mm-input", _TEXT_ONLY, "bool"),
    _r("--scheduler-cls", "the scheduler is built in"),
    _n("--disable-hybrid-kv-cache-manager", "there is one KV-cache manager", "bool"),
    _s("--async-scheduling", "the next window is planned and launched while a window's last step runs "
                             "(default on with CUDA and one rank; --no-async-scheduling turns it off)"),
    _r("--preemption-mode", "preemption always recomputes", accepted=("recompute", "None")),
    _n("--cuda-graph-sizes", "decode CUDA graphs are captured per batch bucket", "values"),
    # ---- whole-engine configs (VllmConfig) --------------------------------------------------
    _s("--speculative-config", "speculative decoding inside windows: ngram (prompt lookup) or draft_model, "
                               "vLLM's JSON object"),
    _r("--kv-transfer-config", "no disaggregated prefill / KV transfer"),
    _r("--kv-events-config", "no KV-cache events"),
    _n("--compilation-config", "no torch.compile; CUDA graphs follow --enforce-eager", accepted=("0",)),
    _n("--additional-config", "no platform plugins"),
    # ---- Lockstep's own engine flags with vLLM's names -----------------------------------------
    _s("--num-scheduler-steps", "decode steps per window (1..64) or auto (vLLM V0's multi-step flag)"),
    _s("--device", "auto, cpu or cuda"),
)

BY_NAME = {flag.name: flag for flag in FLAGS}
# vLLM's spelling of a compilation level: `-O3` is `--compilation-config 3`.
_O_LEVEL = re.compile(r"-O(\d)$")


def register(parser: argparse.ArgumentParser) -> None:
    """Adds every catalogue flag the parser does not define itself; they default to absent."""
    group = parser.add_argument_group("vLLM flags that change nothing here or are refused (docs/API.md)")
    for flag in FLAGS:
        if flag.name in parser._option_string_actions or flag.status == SUPPORTED:
            continue
        names = [name for name in (*flag.aliases, flag.name) if name not in parser._option_string_actions]
        kwargs: dict = {"dest": "vllm_" + flag.dest, "default": argparse.SUPPRESS, "help": f"{flag.status}: {flag.note}"}
        if flag.kind == "bool":
            kwargs["action"] = "store_true"
        elif flag.kind == "bool_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.kind == "values":
            kwargs.update(nargs="+", metavar="VALUE")
        else:
            kwargs["metavar"] = "VALUE"
        group.add_argument(*names, **kwargs)


def expand_argv(argv: list[str]) -> list[str]:
    """vLLM's `-O3` -> `--compilation-config 3`."""
    out = []
    for arg in argv:
        match = _O_LEVEL.match(arg)
        out += ["--compilation-config", match.group(1)] if match else [arg]
    return out


def check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(notices, errors) for the no-effect and refused flags that were given."""
    notices, errors = [], []
    for flag in FLAGS:
        if flag.status == SUPPORTED or not hasattr(args, "vllm_" + flag.dest):
            continue
        value = getattr(args, "vllm_" + flag.dest)
        shown = " ".join(value) if isinstance(value, list) else str(value)
        if shown in flag.accepted:
            continue
        spelled = flag.name if value is True else f"{flag.name} {shown}"
        if flag.status == NO_EFFECT:
            notices.append(f"{spelled}: accepted, no effect here: {flag.note}")
        else:
            errors.append(f"{spelled} is not supported: {flag.note}")
    return notices, errors


# ---- the supported flags this module adds to `lockstep serve` --------------------------------
def add_supported_flags(server, engine) -> None:
    """vLLM's frontend and loading flags that `lockstep serve` implements (argparse groups of serve.py)."""
    server.add_argument("--config", help="YAML file of flags (keys: flag names without --); the command line wins")
    server.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of host:port")
    server.add_argument("--disable-uvicorn-access-log", action="store_true")
    server.add_argument("--allow-credentials", action="store_true", default=None, help="CORS: allow credentials")
    for name in ("origins", "methods", "headers"):
        server.add_argument(f"--allowed-{name}", type=json_list, default=None,
                            help=f'CORS: allowed {name} as a JSON list (default ["*"] once CORS is on)')
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    server.add_argument("--ssl-ca-certs", default=None, help="CA bundle for client certificates")
    server.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                        help="client certificates: 0 none, 1 optional, 2 required")
    server.add_argument("--ssl-ciphers", default=None, help="TLS 1.2 cipher suites")
    server.add_argument("--root-path", default=None, help="ASGI root_path behind a path-prefix proxy")
    server.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc, /openapi.json")
    server.add_argument("--h11-max-incomplete-event-size", type=human_readable_int, default=None,
                        help="uvicorn's h11 limit on an incomplete HTTP event, bytes")
    server.add_argument("--chat-template", default=None, help="a Jinja chat template: a file, or the template itself")
    server.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                        help="message content as the template sees it (text parts are joined into a string)")
    server.add_argument("--response-role", default="assistant", help="the role of generated chat messages")
    server.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                        help="JSON object merged under each request's chat_template_kwargs")
    server.add_argument("--generation-config", default="auto",
                        help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a directory")
    server.add_argument("--override-generation-config", type=json_object, default=None,
                        help='JSON object over the generation config, e.g. \'{"temperature": 0.5}\'')
    engine.add_argument("--download-dir", default=None,
                        help="the Hugging Face cache that hub ids (org/name) are read from (default: HF_HOME's)")
    engine.add_argument("--revision", default=None, help="hub ids: branch, tag or commit of the snapshot (default main)")
    engine.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf"])
    engine.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 4} or {"method": "draft_model", "model": SOURCE, '
                             '"num_speculative_tokens": 3}')
    engine.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT) of the model")
    engine.add_argument("--lora-modules", type=lora_module, nargs="+", default=[], metavar="NAME=PATH",
                        help='adapters loaded at start: name=path, or {"name": .., "path": ..}; the name is the '
                             "request's model")
    engine.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (weight slots, default 1)")
    engine.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default 16)")
    engine.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters registered at once (default: max-loras, or the --lora-modules count)")
    engine.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf", "slow", "mistral", "custom"],
                        help="auto / hf: the fast Hugging Face tokenizer (slow, mistral, custom are refused)")


def frontend_errors(args: argparse.Namespace) -> list[str]:
    """Values of supported flags that this engine refuses."""
    errors = []
    if args.tokenizer_mode not in ("auto", "hf"):
        errors.append(f"--tokenizer-mode {args.tokenizer_mode} is not supported: the fast Hugging Face tokenizer "
                      f"(auto / hf) is the only one")
    if args.chat_template_content_format == "openai":
        errors.append("--chat-template-content-format openai is not supported: message text parts are joined into "
                      "a string for the template")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        errors.append("--ssl-keyfile and --ssl-certfile go together (TLS needs both)")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            errors.append(f"--{name.replace('_', '-')} {path}: no such file")
    if args.root_path is not None and not re.fullmatch(r"(/[^/\s]+)+", args.root_path):
        errors.append(f"--root-path {args.root_path!r} is invalid: expected a path like /api (no trailing slash)")
    return errors


def server_defaults(args: argparse.Namespace, config) -> ServerDefaults:
    """Resolves --chat-template, --response-role, --default-chat-template-kwargs and the generation config
    (the model directory from hf_cache, so a hub id missing from the cache fails here, naming where it looked)."""
    from lockstep_engine.api.server_defaults import ServerDefaults, generation_defaults, load_chat_template
    from lockstep_engine.hf_cache import local_model_dir

    model_dir = local_model_dir(config.model, config.download_dir, config.revision)
    return ServerDefaults(
        chat_template=load_chat_template(args.chat_template),
        response_role=args.response_role,
        chat_template_kwargs=dict(args.default_chat_template_kwargs or {}),
        sampling=generation_defaults(args.generation_config, model_dir, args.override_generation_config),
    )


def cors_options(args: argparse.Namespace) -> dict | None:
    """Starlette CORSMiddleware options, or None when no CORS flag was given (no CORS headers at all)."""
    given = [args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials]
    if all(value is None for value in given):
        return None
    return {"allow_origins": args.allowed_origins or ["*"], "allow_methods": args.allowed_methods or ["*"],
            "allow_headers": args.allowed_headers or ["*"], "allow_credentials": bool(args.allow_credentials)}


def uvicorn_options(args: argparse.Namespace) -> dict:
    options = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
               "ssl_cert_reqs": args.ssl_cert_reqs, "uds": args.uds,
               "access_log": args.uvicorn_log_level in ("info", "debug", "trace") and not args.disable_uvicorn_access_log}
    if args.ssl_ciphers:
        options["ssl_ciphers"] = args.ssl_ciphers
    if args.h11_max_incomplete_event_size is not None:
        options["h11_max_incomplete_event_size"] = args.h11_max_incomplete_event_size
    return options


class RootPath:
    """ASGI wrapper for --root-path: a request under the prefix is routed without it (so auth and the
    routes see /v1/...), root_path is set for URLs the app builds; requests without it pass unchanged,
    as behind a proxy that strips the prefix."""

    def __init__(self, app, root_path: str):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            scope = dict(scope, root_path=self.root_path)
            path = scope["path"]
            if path == self.root_path or path.startswith(self.root_path + "/"):
                scope["path"] = path[len(self.root_path):] or "/"
                scope["raw_path"] = scope["path"].encode()
        await self.app(scope, receive, send)


def without_docs(app) -> None:
    """--disable-fastapi-docs: drops the OpenAPI document and the two UIs."""
    paths = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) not in paths]
    app.openapi_url = app.docs_url = app.redoc_url = None
