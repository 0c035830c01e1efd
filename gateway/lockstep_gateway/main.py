"""`lockstep gateway`: the OpenAI-compatible endpoint in front of the engine groups."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from lockstep_gateway.auth import read_key_file
from lockstep_gateway.config import ROUTING_POLICIES, ConfigError, GatewayConfig

DEFAULTS = GatewayConfig()
ENV_ENGINE_KEY = "LOCKSTEP_ENGINE_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep gateway", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULTS.host)
    server.add_argument("--port", type=int, default=DEFAULTS.port)
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
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
    routing.add_argument("--routing", default=DEFAULTS.routing, choices=ROUTING_POLICIES)
    routing.add_argument("--session-header", default=DEFAULTS.session_header,
                         help="requests with this header (else with the same 'user') stick to one engine")
    routing.add_argument("--session-affinity", action=argparse.BooleanOptionalAction, default=DEFAULTS.session_affinity)
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
    clients.add_argument("--cors-allowed-origin", action="append", default=[], metavar="ORIGIN",
                         help="allow browser calls from ORIGIN (repeatable); CORS is off by default")
    return parser


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
        max_in_flight=args.max_in_flight, header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
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


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[lockstep gateway] %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request otherwise


def header_timeout_protocol(timeout_s: float):
    """uvicorn's httptools protocol, closing a connection whose request headers are not complete
    `timeout_s` after it opened or after its previous response (slowloris): uvicorn itself waits
    for them forever."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()  # the next request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def uvicorn_config(app, config: GatewayConfig):
    import uvicorn

    uvicorn_level = "warning" if config.log_level in ("info", "debug") else config.log_level
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=uvicorn_level, access_log=False,
                          timeout_keep_alive=30, backlog=4096, timeout_graceful_shutdown=5, loop="auto",
                          http=header_timeout_protocol(config.header_timeout_s))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from lockstep_gateway.app import build_app

    config = parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(config.log_level)
    server = uvicorn.Server(uvicorn_config(build_app(config), config))
    logging.getLogger("lockstep.gateway").info("listening on http://%s:%d", config.host, config.port)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
