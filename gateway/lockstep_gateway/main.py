"""`lockstep gateway`: the OpenAI-compatible endpoint in front of the engine groups."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lockstep_common.argparsing import ArgumentParser, port_number
from lockstep_common.header_limits import HttptoolsHeaderLimits
from lockstep_common import logs
from lockstep_common.sockets import bind_sockets, die_with_parent

from lockstep_gateway.auth import read_key_file
from lockstep_gateway.config import ROUTING_POLICIES, ConfigError, GatewayConfig
from lockstep_gateway.flow_control import PRIORITY_HEADER
from lockstep_gateway.workers import supervise

DEFAULTS = GatewayConfig()
BACKLOG = 4096  # bursts of connections
ENV_ENGINE_KEY = "LOCKSTEP_ENGINE_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="lockstep gateway", description=__doc__.split("\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULTS.host)
    server.add_argument("--port", type=port_number, default=DEFAULTS.port, help="1-65535")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--workers", type=int, default=1,
                        help="gateway processes serving the port (SO_REUSEPORT), each with its own routing state "
                             "and limits; about one per core")
    server.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor
    discovery = parser.add_argument_group("discovery (any combination)")
    discovery.add_argument("--engine", action="append", default=[], metavar="URL",
                           help="an engine's base URL, e.g. http://127.0.0.1:8001 (repeatable)")
    discovery.add_argument("--config", dest="config_file", default=None, metavar="FILE",
                           help='JSON/YAML file {"engines": [URL, ...]}, re-read when it changes')
    discovery.add_argument("--kubernetes-namespace", action="append", default=[], metavar="NS",
                           help="watch the EndpointSlices of LLMService leader Services in NS (repeatable; "
                                "comma-separated lists work too)")
    discovery.add_argument("--kubernetes-all-namespaces", action="store_true",
                           help="watch them in every namespace (needs a ClusterRole to list/watch endpointslices)")
    discovery.add_argument("--kubernetes-label-selector", default=DEFAULTS.kubernetes_label_selector)
    discovery.add_argument("--kubeconfig", default=None,
                           help="outside a pod: the kubeconfig to use (default $KUBECONFIG, ~/.kube/config)")
    routing = parser.add_argument_group("routing")
    routing.add_argument("--routing", default=DEFAULTS.routing, choices=ROUTING_POLICIES,
                         help="how an engine is chosen for a request (docs/GATEWAY.md, Routing)")
    routing.add_argument("--session-header", default=DEFAULTS.session_header,
                         help="requests with this header (else with the same 'user') stick to one engine")
    routing.add_argument("--session-affinity", action=argparse.BooleanOptionalAction, default=DEFAULTS.session_affinity)
    add_flow_control_flags(parser)
    health = parser.add_argument_group("engine health and load")
    health.add_argument("--health-check-interval", type=float, default=DEFAULTS.health_check_interval_s)
    health.add_argument("--health-check-timeout", type=float, default=DEFAULTS.health_check_timeout_s)
    health.add_argument("--unhealthy-threshold", type=int, default=DEFAULTS.unhealthy_threshold,
                        help="timed-out checks in a row that eject an engine (refusals and 503 eject at once); "
                             "after one, the engine gets no new requests while another can take them")
    health.add_argument("--healthy-threshold", type=int, default=DEFAULTS.healthy_threshold,
                        help="passing checks in a row that readmit an engine")
    health.add_argument("--metrics-interval", type=float, default=DEFAULTS.metrics_interval_s,
                        help="seconds between scrapes of each engine's /metrics")
    health.add_argument("--metrics-stale", type=float, default=DEFAULTS.metrics_stale_s,
                        help="scraped load older than this is ignored")
    health.add_argument("--saturation-queue-depth", type=int, default=DEFAULTS.saturation_queue_depth,
                        help="an engine with this many waiting requests takes no more (0 = no limit)")
    health.add_argument("--max-in-flight-per-engine", type=int, default=DEFAULTS.max_in_flight_per_engine,
                        help="requests this gateway keeps open per engine (0 = no limit)")
    health.add_argument("--breaker-failures", type=int, default=DEFAULTS.breaker_failures,
                        help="failed requests in a row that open an engine's circuit breaker")
    health.add_argument("--breaker-cooldown", type=float, default=DEFAULTS.breaker_cooldown_s,
                        help="seconds an open breaker keeps the engine out before one probe request")
    upstream = parser.add_argument_group("upstream timeouts and retries")
    upstream.add_argument("--connect-timeout", type=float, default=DEFAULTS.connect_timeout_s)
    upstream.add_argument("--first-byte-timeout", type=float, default=DEFAULTS.first_byte_timeout_s,
                          help="seconds to the first byte of the engine's answer")
    upstream.add_argument("--idle-timeout", type=float, default=DEFAULTS.idle_timeout_s,
                          help="seconds a stream may go without a chunk")
    upstream.add_argument("--max-retries", type=int, default=DEFAULTS.max_retries,
                          help="other engines tried for a request no engine accepted (refused connection, "
                               "a 503 marked retryable)")
    upstream.add_argument("--retry-budget-ratio", type=float, default=DEFAULTS.retry_budget_ratio,
                          help="retries in progress at most this share of the requests in progress")
    upstream.add_argument("--retry-budget-min", type=int, default=DEFAULTS.retry_budget_min,
                          help="retries in progress always allowed, whatever the ratio")
    upstream.add_argument("--engine-api-key-file", default=None, metavar="PATH",
                          help=f"the engines' --api-key, sent as a Bearer token on proxied requests, health checks "
                               f"and scrapes (a file or a mounted Secret's file; also ${ENV_ENGINE_KEY})")
    upstream.add_argument("--retry-after", dest="retry_after_s", type=int, default=DEFAULTS.retry_after_s,
                          help="Retry-After seconds on 503")
    clients = parser.add_argument_group("clients")
    clients.add_argument("--api-key-file", action="append", default=[], metavar="PATH",
                         help="keys, one per line, or a directory with one key per file (a mounted Secret); "
                              "also $LOCKSTEP_API_KEYS (comma-separated). No keys: no authentication")
    clients.add_argument("--rate-limit-rpm", type=int, default=0, help="requests per minute per key (0 = none)")
    clients.add_argument("--rate-limit-tpm", type=int, default=0,
                         help="tokens (prompt + completion) per minute per key (0 = none)")
    clients.add_argument("--max-request-body-bytes", type=int, default=DEFAULTS.max_body_bytes)
    clients.add_argument("--max-in-flight", type=int, default=DEFAULTS.max_in_flight,
                         help="requests in progress at once; past it 503 + Retry-After (0 = no limit)")
    clients.add_argument("--header-timeout", type=float, default=DEFAULTS.header_timeout_s,
                         help="seconds a connection gets to send a request's headers before it is closed")
    clients.add_argument("--body-timeout", type=float, default=DEFAULTS.body_timeout_s,
                         help="seconds a request gets to send its body (408 after)")
    clients.add_argument("--trusted-proxies", default="", metavar="CIDR,...",
                         help="peers whose X-Forwarded-For names the client (for per-address rate limits "
                              "without keys), e.g. the ingress: 10.0.0.0/8")
    clients.add_argument("--priority-api-key-file", action="append", default=[], metavar="PATH",
                         help=f"keys (also accepted as API keys) whose requests may set {PRIORITY_HEADER} and a body "
                              "priority below 0; from anyone else the header is ignored")
    clients.add_argument("--priority-trusted-proxies", default="", metavar="CIDR,...",
                         help=f"peers whose {PRIORITY_HEADER} is honoured: a proxy that sets it from its own "
                              "configuration")
    clients.add_argument("--cors-allowed-origin", action="append", default=[], metavar="ORIGIN",
                         help="allow browser calls from ORIGIN (repeatable); CORS is off by default")
    return parser


def add_flow_control_flags(parser: argparse.ArgumentParser) -> None:
    """--max-queue-length, --max-queue-bytes and --queue-timeout, as `lockstep gateway` and `lockstep up` take them."""
    queue = parser.add_argument_group("flow control (requests no engine can take yet wait in a queue per model)")
    queue.add_argument("--max-queue-length", type=int, default=DEFAULTS.max_queue_length,
                       help="requests queued per model at most; past it 429 + Retry-After (0 = no queue: 503 at "
                            "once when every engine is saturated or down)")
    queue.add_argument("--max-queue-bytes", type=int, default=DEFAULTS.max_queue_bytes,
                       help="memory the queued requests may hold, over all models (bodies plus about 28 KiB each); "
                            "past it 429 + Retry-After")
    queue.add_argument("--queue-timeout", type=float, default=DEFAULTS.queue_timeout_s,
                       help="a request is queued only if its engines, at their measured rate, reach it within "
                            "this many seconds; a queued one gets 429 when no request left the queue for this long")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host, port=args.port, log_level=args.log_level,
        engines=tuple(args.engine), config_file=args.config_file,
        kubernetes_namespaces=comma_separated(*args.kubernetes_namespace),
        kubernetes_all_namespaces=args.kubernetes_all_namespaces,
        kubernetes_label_selector=args.kubernetes_label_selector, kubeconfig=args.kubeconfig,
        routing=args.routing, session_header=args.session_header, session_affinity=args.session_affinity,
        health_check_interval_s=args.health_check_interval, health_check_timeout_s=args.health_check_timeout,
        unhealthy_threshold=args.unhealthy_threshold, healthy_threshold=args.healthy_threshold,
        metrics_interval_s=args.metrics_interval, metrics_stale_s=args.metrics_stale,
        saturation_queue_depth=args.saturation_queue_depth, max_in_flight_per_engine=args.max_in_flight_per_engine,
        breaker_failures=args.breaker_failures, breaker_cooldown_s=args.breaker_cooldown,
        connect_timeout_s=args.connect_timeout, first_byte_timeout_s=args.first_byte_timeout,
        idle_timeout_s=args.idle_timeout, max_retries=args.max_retries, retry_after_s=args.retry_after_s,
        retry_budget_ratio=args.retry_budget_ratio, retry_budget_min=args.retry_budget_min,
        engine_api_key=engine_key(args.engine_api_key_file),
        max_in_flight=args.max_in_flight, max_queue_length=args.max_queue_length, queue_timeout_s=args.queue_timeout,
        max_queue_bytes=args.max_queue_bytes, priority_api_key_files=tuple(args.priority_api_key_file),
        priority_trusted_proxies=comma_separated(args.priority_trusted_proxies),
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        trusted_proxies=comma_separated(args.trusted_proxies),
        api_key_files=tuple(args.api_key_file), rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm, max_body_bytes=args.max_request_body_bytes,
        cors_allowed_origins=tuple(args.cors_allowed_origin),
    )


def comma_separated(*values: str) -> tuple[str, ...]:
    """The items of flags that take comma-separated lists (and may be repeated), blanks dropped."""
    return tuple(item.strip() for value in values for item in value.split(",") if item.strip())


def engine_key(path: str | None, environ=os.environ) -> str | None:
    """The key the engines were started with: from the file (its first key) or the environment."""
    if path:
        keys = read_key_file(path)
        if not keys:
            raise ConfigError(f"--engine-api-key-file={path!r} holds no key")
        return keys[0]
    return environ.get(ENV_ENGINE_KEY) or None


def parse_args(argv: list[str]) -> GatewayConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"--engine-api-key-file: {error}")
    if not config.has_discovery:
        parser.error("no engines: give --engine URL, --config FILE, --kubernetes-namespace NS or "
                     "--kubernetes-all-namespaces")
    if config.kubernetes_all_namespaces and config.kubernetes_namespaces:
        parser.error("--kubernetes-all-namespaces and --kubernetes-namespace exclude each other")
    return config


def configure_logging(level: str, worker_index: int | None = None) -> None:
    name = "lockstep gateway" if worker_index is None else f"lockstep gateway worker {worker_index}"
    logs.configure_logging(f"[{name}] %(levelname)s %(message)s", level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request otherwise


def header_timeout_protocol(timeout_s: float):
    """uvicorn's httptools protocol with the header deadline, header size limit and OpenAI-shaped protocol errors
    the engine has too (lockstep_common.header_limits): uvicorn's own waits for headers for ever and sets no limit."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttptoolsHeaderLimits, HttpToolsProtocol):
        header_timeout_s = timeout_s  # what the health listener reads (lockstep_common/health_server.py)

    return HeaderTimeoutProtocol


def uvicorn_config(app, config: GatewayConfig):
    import uvicorn

    uvicorn_level = "warning" if config.log_level in ("info", "debug") else config.log_level
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=uvicorn_level, access_log=False,
                          timeout_keep_alive=30, backlog=BACKLOG, timeout_graceful_shutdown=5, loop="auto",
                          http=header_timeout_protocol(config.header_timeout_s))


def gateway_server(app, config: GatewayConfig, worker_index: int | None = None, handle_signals: bool = True):
    """uvicorn's server with `/health` and `/ping` answered by a health listener process off its event loop
    (lockstep_common/health_listener.py), from the answer `health.probe_answer` builds every 50 ms. With
    `--workers N` every worker runs its own listener on its own SO_REUSEPORT socket (docs/RELIABILITY.md).
    `handle_signals=False`: the caller's loop handles SIGINT/SIGTERM (`lockstep up`)."""
    import contextlib

    import uvicorn
    from lockstep_common.health_server import HealthListenerMixin

    from lockstep_gateway.health import probe_answer

    name = "lockstep gateway" if worker_index is None else f"lockstep gateway worker {worker_index}"

    class GatewayServer(HealthListenerMixin, uvicorn.Server):
        listener_log_format = f"[{name} health listener] %(levelname)s %(message)s"

        def probe_answer(self):
            return probe_answer(app.state.gateway.registry)

        @contextlib.contextmanager
        def capture_signals(self):
            if handle_signals:
                with super().capture_signals():
                    yield
            else:
                yield

    return GatewayServer(uvicorn_config(app, config))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers={args.workers!r} is out of range: allowed >= 1")
    config = parse_args(argv)
    if args.workers > 1 and args.worker_index is None:
        configure_logging(config.log_level)
        return supervise(argv, config.host, config.port, args.workers)
    configure_logging(config.log_level, args.worker_index)

    from lockstep_gateway.app import build_app

    server = gateway_server(build_app(config), config, args.worker_index)
    if args.worker_index is None:
        logging.getLogger("lockstep.gateway").info("listening on http://%s:%d", config.host, config.port)
        server.run()
        return server.exit_code or (0 if server.started else 1)  # 1: its health listener died
    die_with_parent()
    try:
        server.prebound = bind_sockets(config.host, config.port, BACKLOG, reuse_port=True)
    except OSError as error:
        logging.getLogger("lockstep.gateway").error("cannot bind %s:%d: %s", config.host, config.port, error)
        return 1
    server.run()
    return server.exit_code or (0 if server.started else 1)


if __name__ == "__main__":
    sys.exit(main())
