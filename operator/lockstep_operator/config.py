"""The operator's settings: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from lockstep_operator.constants import DEFAULT_ENGINE_IMAGE


@dataclass(frozen=True)
class OperatorConfig:
    # Namespaces to watch; empty means every namespace.
    namespaces: tuple[str, ...] = ()
    engine_image: str = DEFAULT_ENGINE_IMAGE
    cluster_domain: str = "cluster.local"
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8080  # 0 disables the /metrics server
    health_port: int = 8081  # 0 disables kopf's liveness endpoint
    # Every LLMService is reconciled at least this often, even when no event arrives.
    resync_seconds: float = 60.0
    log_level: str = "INFO"
    # A NetworkPolicy per LLMService (engine HTTP) and per group (rank-to-rank traffic).
    network_policy: bool = True
    # Namespaces whose pods labelled serving.lockstep.dev/engine-client=true may call engine HTTP
    # (the gateway's); empty means such pods in any namespace.
    engine_client_namespaces: tuple[str, ...] = ()
    # Namespaces whose every pod may scrape engine /metrics (Prometheus).
    monitoring_namespaces: tuple[str, ...] = ()
    # A group that keeps failing before it is ready is restarted at most this often: the first restart
    # at once, then at least restart_backoff_seconds after the previous one, doubling up to the maximum.
    restart_backoff_seconds: float = 15.0
    restart_backoff_max_seconds: float = 300.0
    # spec.autoscaling: how often the demand is read, and where the gateways are (pods matching
    # gateway_selector in gateway_namespace, their /metrics on gateway_metrics_port).
    autoscale_interval_seconds: float = 5.0
    gateway_namespace: str = ""
    gateway_selector: str = ""
    gateway_metrics_port: int = 8000

    def __post_init__(self) -> None:
        if not self.engine_image or self.engine_image.endswith(":latest"):
            raise ValueError(f"engine_image must be a pinned image reference, got {self.engine_image!r}")
        for name in ("metrics_port", "health_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if not 0 < self.restart_backoff_seconds <= self.restart_backoff_max_seconds:
            raise ValueError(
                "restart_backoff_seconds must be > 0 and at most restart_backoff_max_seconds, got "
                f"{self.restart_backoff_seconds} and {self.restart_backoff_max_seconds}"
            )
        if self.autoscale_interval_seconds <= 0:
            raise ValueError(f"autoscale_interval_seconds must be > 0, got {self.autoscale_interval_seconds}")
        if self.resync_seconds <= 0:
            raise ValueError(f"resync_seconds must be > 0, got {self.resync_seconds}")
        if not self.cluster_domain or self.cluster_domain.startswith("."):
            raise ValueError(f"cluster_domain must be a DNS name, got {self.cluster_domain!r}")
