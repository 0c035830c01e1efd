"""`GatewayConfig`: every setting of one gateway process, frozen and validated once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from lockstep_gateway.routing.registry import POLICIES

ROUTING_POLICIES = tuple(POLICIES)
DEFAULT_LABEL_SELECTOR = "app.kubernetes.io/component=engine-leader"


class ConfigError(ValueError):
    """A setting a user gave is out of range; the message names the flag."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    # discovery
    engines: tuple[str, ...] = ()
    config_file: str | None = None
    kubernetes_namespaces: tuple[str, ...] = ()
    kubernetes_all_namespaces: bool = False
    kubernetes_label_selector: str = DEFAULT_LABEL_SELECTOR
    kubeconfig: str | None = None
    # routing
    routing: str = "prefix-aware"  # least-load when a prompt shares no prefix (docs/BENCHMARKS.md)
    session_header: str = "x-session-id"
    session_affinity: bool = True
    # engine health and load
    health_check_interval_s: float = 1.0
    health_check_timeout_s: float = 2.0
    unhealthy_threshold: int = 3
    healthy_threshold: int = 1
    metrics_interval_s: float = 0.5
    metrics_stale_s: float = 3.0
    saturation_queue_depth: int = 256
    max_in_flight_per_engine: int = 0
    max_in_flight: int = 32768
    # flow control: requests no engine can take yet wait in a queue per model, admitted while its engines
    # can be expected to serve them within the queue timeout (lockstep_gateway/flow_control.py)
    max_queue_length: int = 65536
    max_queue_bytes: int = 512 << 20
    queue_timeout_s: float = 300.0
    # upstream timeouts and retries
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0
    idle_timeout_s: float = 30.0
    max_retries: int = 2
    retry_budget_ratio: float = 0.2
    retry_budget_min: int = 3
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    retry_after_s: int = 1
    engine_api_key: str | None = field(default=None, repr=False)
    # clients
    api_key_files: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    rate_limit_rpm: int = 0
    rate_limit_tpm: int = 0
    max_body_bytes: int = 16 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    trusted_proxies: tuple[str, ...] = ()
    # who may set x-gateway-priority (and a body priority below 0): these keys, and these peers
    priority_api_key_files: tuple[str, ...] = ()
    priority_trusted_proxies: tuple[str, ...] = ()
    cors_allowed_origins: tuple[str, ...] = ()
    log_level: str = "info"

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "--port", self.port, "0..65535")
        _check(self.routing in ROUTING_POLICIES, "--routing", self.routing, " | ".join(ROUTING_POLICIES))
        for name in ("health_check_interval_s", "health_check_timeout_s", "metrics_interval_s", "metrics_stale_s",
                     "connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "breaker_cooldown_s",
                     "header_timeout_s", "body_timeout_s", "queue_timeout_s"):
            _check(getattr(self, name) > 0, _flag(name), getattr(self, name), "> 0 seconds")
        for name in ("unhealthy_threshold", "healthy_threshold", "retry_after_s", "breaker_failures"):
            _check(getattr(self, name) >= 1, _flag(name), getattr(self, name), ">= 1")
        for name in ("saturation_queue_depth", "max_in_flight_per_engine", "max_in_flight", "max_retries",
                     "retry_budget_min", "rate_limit_rpm", "rate_limit_tpm"):
            _check(getattr(self, name) >= 0, _flag(name), getattr(self, name), ">= 0 (0 = no limit)")
        _check(self.max_queue_length >= 0, "--max-queue-length", self.max_queue_length,
               ">= 0 (0 = no queue: 503 at once when no engine can take a request)")
        _check(self.max_queue_bytes >= 1 << 20, "--max-queue-bytes", self.max_queue_bytes, ">= 1048576 (1 MiB)")
        _check(0 <= self.retry_budget_ratio <= 1, "--retry-budget-ratio", self.retry_budget_ratio, "0..1")
        for flag, proxies in (("--trusted-proxies", self.trusted_proxies),
                              ("--priority-trusted-proxies", self.priority_trusted_proxies)):
            for proxy in proxies:
                try:
                    ipaddress.ip_network(proxy, strict=False)
                except ValueError:
                    _check(False, flag, proxy, "IP addresses or CIDR ranges, comma-separated")
        _check(self.max_body_bytes >= 1024, "--max-request-body-bytes", self.max_body_bytes, ">= 1024")
        _check(bool(self.session_header.strip()), "--session-header", self.session_header, "a header name")
        for url in self.engines:
            _check(url.startswith(("http://", "https://")), "--engine", url, "an http:// or https:// URL")

    @property
    def has_discovery(self) -> bool:
        return bool(self.engines or self.config_file or self.kubernetes_namespaces or self.kubernetes_all_namespaces)


def _flag(name: str) -> str:
    flag = name.removesuffix("_s").replace("_", "-")
    return f"--{flag}"


def _check(ok: bool, flag: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{flag}={value!r} is out of range: allowed {allowed}")
