"""`lockstep serve MODEL`: the OpenAI-compatible engine server, with vLLM's flag names.

Three processes: this one runs uvicorn + FastAPI, the tokenizer and streaming; the engine core runs
the model in a process of its own (spawned by the API server), so HTTP work never delays a step. A
third, small one, the health listener (lockstep_common/health_listener.py), owns the listening socket: it
answers `/health` itself, so probes never wait for a busy event loop, and passes every other connection on.
SIGTERM (or Ctrl-C) drains: `/health` and new requests get 503, requests in flight finish within
`--shutdown-grace-period` (then they are aborted), the engine core stops, and the exit code is 0.
A second signal exits at once.

`--api-server-count N` (N > 1) runs N API-server processes on the one port, all feeding one engine core
(entrypoints/api_servers.py supervises them; docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from dataclasses import fields

from lockstep_common.argparsing import ArgumentParser, port_number
from lockstep_engine.config import (
    ATTENTION_BACKENDS,
    DEFAULT_LONG_PREFILL_TOKENS,
    SCHEDULING_POLICIES,
    VLLM_ATTENTION_BACKENDS,
    ConfigError,
    EngineConfig,
    num_scheduler_steps_arg,
)
from lockstep_engine.entrypoints import vllm_flags
from lockstep_engine.entrypoints.cli_values import config_file_args, human_readable_int

DEFAULT_PORT = 8000


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="lockstep serve", description=__doc__.split("\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", nargs="?",
                        help="smollm2, random:<shape>, a .gguf file, a Hugging Face directory or hub id (org/name)")
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="1-65535")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: MODEL)")
    server.add_argument("--api-key", default=os.environ.get("LOCKSTEP_API_KEY") or os.environ.get("VLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (env LOCKSTEP_API_KEY or VLLM_API_KEY)")
    server.add_argument("--api-key-file", default=os.environ.get("LOCKSTEP_API_KEY_FILE"),
                        help="read the API key from this file, e.g. a mounted Secret (env LOCKSTEP_API_KEY_FILE)")
    server.add_argument("--max-queued-requests", type=int, default=-1,
                        help="requests that may wait beyond --max-num-seqs; more get 503 with Retry-After "
                             "(-1: no count, --max-queued-memory-bytes bounds them)")
    server.add_argument("--max-queued-memory-bytes", type=human_readable_int, default=1 << 30,
                        help="memory the requests waiting beyond --max-num-seqs may hold (a waiting request holds "
                             "its prompt, not KV: about 16 bytes per byte of its body plus 46 KiB); past it 503 "
                             "with Retry-After. e.g. 1G (GiB), 512M")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="render chat templates sent in requests (chat_template_kwargs.chat_template)")
    server.add_argument("--header-read-timeout", type=float, default=10.0,
                        help="seconds a client may take to send a request's headers before the connection closes")
    server.add_argument("--body-read-timeout", type=float, default=60.0,
                        help="seconds a client may take to send a request's body (else 408)")
    server.add_argument("--keep-alive-timeout", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open")
    server.add_argument("--max-request-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    server.add_argument("--request-idle-timeout", type=float, default=600.0,
                        help="seconds the engine may send no token to any request while a request waits "
                             "for its next one; then the request fails (waiting in a busy engine's queue is "
                             "not idle)")
    server.add_argument("--shutdown-grace-period", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    server.add_argument("--engine-start-timeout", type=float, default=1800.0,
                        help="seconds the engine core may take to load the model")
    server.add_argument("--engine-heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a heartbeat (sent every 0.5 s) before the engine core counts as dead "
                             "and the server exits")
    server.add_argument("--engine-stall-timeout", type=float, default=300.0,
                        help="seconds without a finished step before the engine loop counts as stuck")
    server.add_argument("--stream-interval", type=int, default=1,
                        help="tokens of a request per streamed chunk (vLLM's flag): 1 sends every token as it comes; "
                             "N > 1 sends a request's first token at once and then waits for N more tokens, or its "
                             "end, fewer chunks for the same text")
    server.add_argument("--api-server-count", type=int, default=1,
                        help="API-server processes (HTTP, tokenization, streaming) serving the port, all feeding the "
                             "one engine core; the admission limits are split evenly between them")
    # Set by the supervisor of --api-server-count N for each API server it starts.
    server.add_argument("--api-server-index", type=int, default=None, help=argparse.SUPPRESS)
    server.add_argument("--engine-core-fd", type=int, default=None, help=argparse.SUPPRESS)
    server.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    server.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    engine = parser.add_argument_group("engine (vLLM's names)")
    engine.add_argument("--num-scheduler-steps", type=num_scheduler_steps_arg, default=8,
                        help="decode steps per window, or 'auto'")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    engine.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    engine.add_argument("--pipeline-layer-partition", default=os.environ.get("LOCKSTEP_PP_LAYER_PARTITION"),
                        help="decoder layers per pipeline stage, e.g. 19,11 (default: env LOCKSTEP_PP_LAYER_PARTITION, "
                             "else balanced by the weight each stage reads per step)")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-model-len", type=human_readable_int, default=None, help="e.g. 2048, 32k, 32K")
    engine.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None, help="e.g. 4G (GiB), 4g")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--long-prefill-token-threshold", type=human_readable_int, default=DEFAULT_LONG_PREFILL_TOKENS,
                        help="a prompt with more tokens left than this computes at most this many per step, so "
                             "streams decoding beside it keep their pace (0: chunked by --max-num-batched-tokens only)")
    engine.add_argument("--max-long-partial-prefills", type=int, default=1,
                        help="long prompts (over --long-prefill-token-threshold) partly computed at once")
    engine.add_argument("--scheduling-policy", default="lof", choices=list(SCHEDULING_POLICIES),
                        help="queue order: fcfs (arrival), lof (longest max_tokens first; a request that "
                             "waited --lof-max-wait seconds goes ahead of fresh ones), or priority (the "
                             "request's priority, lowest first, then arrival; vLLM's)")
    engine.add_argument("--lof-max-wait", dest="lof_max_wait_s", type=float, default=2.0,
                        help="seconds a request may wait under lof before it is admitted ahead of longer "
                             "fresh requests (inf: no bound)")
    engine.add_argument("--arrival-cuts", action=argparse.BooleanOptionalAction, default=True,
                        help="an arriving request ends the running window after its step in flight, so it "
                             "starts at the next step (--no-arrival-cuts: windows run their planned steps)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap: the next window is planned and launched while a window's last step runs "
                             "(default: on with CUDA and one rank, off on the CPU and in engine groups)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--tokenizer", default=None)
    engine.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                        default=VLLM_ATTENTION_BACKENDS.get(os.environ.get("VLLM_ATTENTION_BACKEND", ""), "auto"),
                        help="paged attention kernels: auto (per phase, the measured fastest on this GPU), triton, "
                             "flash-attn (FlashAttention-4: pip install 'lockstep[flash-attn]'), torch; default "
                             "from VLLM_ATTENTION_BACKEND (TRITON_ATTN, FLASH_ATTN, TORCH_SDPA) when set")
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--prefill-cuda-graphs", choices=["auto", "on", "off"], default="auto",
                        help="run a window's first step, when it carries prompt tokens, as a CUDA graph replay over "
                             "padded token buckets (auto: where the warm-up measures the replay at most half the "
                             "eager step's time, i.e. small models whose eager step is kernel launches; the default)")
    engine.add_argument("--skip-warmup", action="store_true",
                        help="report ready without compiling kernels and capturing graphs first (the first "
                             "requests then pay for them)")
    engine.add_argument("--max-logprobs", type=int, default=20)
    vllm_flags.add_supported_flags(server, engine)
    vllm_flags.register(parser)  # the rest of vLLM's flags: a notice, or a refusal that says why
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto" (needs --tool-call-parser)')
    server.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "pythonic"],
                        help="how tool calls are read from the model's text for tool_choice auto")
    server.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                        help="return a reasoning model's <think>...</think> text as reasoning_content (chat), "
                             "reasoning items (/v1/responses) and thinking blocks (/v1/messages)")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    values = {name: getattr(args, name) for name in known if hasattr(args, name)}
    values["model"] = args.model
    values["served_model_name"] = args.served_model_name[0] if args.served_model_name else None
    return EngineConfig(**values)


def parse_args(argv: list[str]):
    from lockstep_engine.api.app import ServerSettings
    from lockstep_engine.api.client import CoreTimeouts

    parser = build_parser()
    argv = vllm_flags.expand_argv(config_file_args(argv, parser))
    args = parser.parse_args(argv)
    notices, errors = vllm_flags.check(args)
    errors += vllm_flags.frontend_errors(args)
    if errors:
        parser.error("; ".join(errors))
    for notice in notices:
        print(f"lockstep serve: {notice}", file=sys.stderr)
    if args.model_flag:
        args.model = args.model_flag
    if not args.model:
        parser.error("MODEL is required (e.g. lockstep serve smollm2)")
    try:
        config = engine_config_from_args(args)
    except ConfigError as error:
        parser.error(str(error))
    try:
        defaults = vllm_flags.server_defaults(args, config)
    except ValueError as error:  # DefaultsError, HubCacheError: the message names the flag or the paths
        parser.error(str(error))
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes={args.max_request_body_bytes} is out of range: allowed >= 1")
    for name in ("header_read_timeout", "body_read_timeout", "keep_alive_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is out of range: expected seconds > 0")
    if args.max_queued_requests < -1:
        parser.error(f"--max-queued-requests={args.max_queued_requests} is out of range: expected -1 or more")
    if args.max_queued_memory_bytes < 1 << 20:
        parser.error(f"--max-queued-memory-bytes={args.max_queued_memory_bytes} is out of range: expected 1M or more")
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as handle:
                args.api_key = handle.read().strip()
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"--api-key-file={args.api_key_file!r} cannot be read: {error}")
        if not args.api_key:
            parser.error(f"--api-key-file={args.api_key_file!r} is empty")
    error = api_server_count_error(args)
    if error is not None:
        parser.error(error)
    if args.stream_interval < 1:
        parser.error(f"--stream-interval={args.stream_interval}: must be an integer >= 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or pythonic)")
    settings = ServerSettings(
        served_model_names=list(args.served_model_name or [args.model]),
        api_key=args.api_key or None,
        max_body_bytes=args.max_request_body_bytes,
        request_idle_timeout_s=args.request_idle_timeout,
        shutdown_grace_s=args.shutdown_grace_period,
        core_timeouts=CoreTimeouts(startup_s=args.engine_start_timeout, heartbeat_s=args.engine_heartbeat_timeout,
                                   loop_stall_s=args.engine_stall_timeout),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        gpu_memory_utilization=args.gpu_memory_utilization if any(
            arg.split("=")[0] == "--gpu-memory-utilization" for arg in argv) else None,
        defaults=defaults,
        max_queued_requests=None if args.max_queued_requests == -1 else args.max_queued_requests,
        max_queued_memory_bytes=args.max_queued_memory_bytes,
        body_read_timeout_s=args.body_read_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        stream_interval=args.stream_interval,
    )
    return args, config, settings


def api_server_count_error(args: argparse.Namespace) -> str | None:
    """Why `--api-server-count` cannot be used with these flags; None when it can."""
    count = args.api_server_count
    if count < 1:
        return f"--api-server-count={count} is out of range: allowed >= 1"
    if count > 1 and args.uds:
        return (f"--api-server-count={count} cannot be used with --uds: several API servers share a TCP port "
                f"(SO_REUSEPORT); use --api-server-count 1 with a Unix socket")
    if args.api_server_index is not None and not 0 <= args.api_server_index < count:
        return f"--api-server-index={args.api_server_index} is out of range: allowed 0..{count - 1}"
    if args.api_server_index is not None and (args.engine_core_fd is None or args.run_dir is None):
        return "--api-server-index is set by the supervisor of --api-server-count, with --engine-core-fd and --run-dir"
    return None


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on, checked before the model loads; None when it can."""
    try:
        socket.create_server((host, port)).close()
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from lockstep_engine.api.app import build_app, probe_answer
    from lockstep_engine.api.health_server import PROBE_PATHS, HealthListenerServer
    from lockstep_engine.api.http_limits import header_timeout_protocol
    from lockstep_engine.log import log

    argv = list(sys.argv[1:] if argv is None else argv)
    args, config, settings = parse_args(argv)
    if args.api_server_index is not None:
        from lockstep_engine.entrypoints.api_servers import api_server_group

        settings.group = api_server_group(args.api_server_index, args.api_server_count, args.run_dir,
                                          args.engine_core_fd)
    # Another listener on the port, SO_REUSEPORT or not, fails this plain bind (the API servers' own do not).
    taken = None if args.uds or settings.group is not None else port_taken(args.host, args.port)
    if taken is not None:
        log(f"error: --port {args.port}: cannot listen on {args.host}: {taken} (is the port taken?)")
        return 1
    if args.api_server_count > 1 and settings.group is None:
        from lockstep_engine.entrypoints.api_servers import supervise

        return supervise(argv, args.host, args.port, args.api_server_count, config, args.shutdown_grace_period)
    app = build_app(config, settings)
    state = app.state.server
    if args.disable_fastapi_docs:
        vllm_flags.without_docs(app)
    asgi = app
    cors = vllm_flags.cors_options(args)
    if cors is not None:
        from starlette.middleware.cors import CORSMiddleware

        asgi = CORSMiddleware(asgi, **cors)
    if args.root_path:
        asgi = vllm_flags.RootPath(asgi, args.root_path)

    class DrainingServer(HealthListenerServer):
        """uvicorn's server with a drain on the first SIGTERM/SIGINT instead of closing the listener, and
        /health answered off the event loop (lockstep_common/health_listener.py)."""

        exit_code = 0
        _drain_task = None
        # --root-path: RootPath routes /prefix/health to /health as well
        probe_paths = PROBE_PATHS + tuple(args.root_path.encode() + p for p in PROBE_PATHS) if args.root_path \
            else PROBE_PATHS

        def probe_answer(self):
            return probe_answer(state)

        def handle_exit(self, sig, frame):
            if sig == signal.SIGINT and settings.group is not None:
                return  # a terminal's Ctrl-C: the supervisor passes it on as SIGTERM
            if self._drain_task is not None or not self.started:
                self.should_exit = True
                self.force_exit = self._drain_task is not None
                return
            loop = asyncio.get_event_loop()
            self._drain_task = True
            loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

        def _start_drain(self, name: str) -> None:
            log(f"{name}: shutting down")
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            await state.drain()
            self.should_exit = True

    uv_config = uvicorn.Config(asgi, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=5,  # generation requests were drained already
                               http=header_timeout_protocol(args.header_read_timeout),
                               timeout_keep_alive=args.keep_alive_timeout, backlog=4096,  # bursts of connections
                               **vllm_flags.uvicorn_options(args))
    server = DrainingServer(uv_config)
    if settings.group is not None:
        from lockstep_common.sockets import bind_sockets, die_with_parent

        die_with_parent()
        try:
            server.prebound = bind_sockets(args.host, args.port, uv_config.backlog, reuse_port=True)
        except OSError as error:
            log(f"error: --port {args.port}: cannot listen on {args.host}: {error}")
            return 1

    def on_fatal(message: str) -> None:
        server.exit_code = 1
        server.should_exit = True

    state.on_fatal = on_fatal
    where = f"unix:{args.uds}" if args.uds else f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"
    who = "" if settings.group is None else f"API server {settings.group.index}: "
    log(f"{who}serving {config.model!r} as {settings.served_model_names} on {where}{args.root_path or ''} "
        f"(num_scheduler_steps={config.num_scheduler_steps})")
    server.run()
    if server.exit_code == 0 and not server.started:
        return 1  # could not bind the port
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
