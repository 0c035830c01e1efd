"""`lockstep operator`: runs the LLMService operator (kopf) with the project's settings."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from lockstep_common.argparsing import ArgumentParser
from lockstep_common.logs import configure_logging
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import DEFAULT_ENGINE_IMAGE

log = logging.getLogger("lockstep_operator")


def parse_args(argv: list[str]) -> OperatorConfig:
    parser = ArgumentParser(
        prog="lockstep operator",
        description="Reconcile LLMService resources (serving.lockstep.dev/v1alpha1) into engine groups.",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        dest="namespaces",
        help="watch this namespace (repeatable); default: every namespace",
    )
    parser.add_argument(
        "--engine-image",
        default=DEFAULT_ENGINE_IMAGE,
        help="engine image for LLMServices that set none (default %(default)s)",
    )
    parser.add_argument(
        "--cluster-domain", default="cluster.local", help="cluster DNS domain (default %(default)s)"
    )
    parser.add_argument(
        "--metrics-host", default="0.0.0.0", help="address of the /metrics server (default %(default)s)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="port of the /metrics server, 0 = off (default %(default)s)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=8081,
        help="port of the /healthz liveness endpoint, 0 = off (default %(default)s)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=60.0,
        help="reconcile every LLMService at least this often (default %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give every LLMService NetworkPolicies: engine HTTP only from engine clients and "
        "monitoring, group ports only from the same group (default on)",
    )
    parser.add_argument(
        "--engine-client-namespace",
        action="append",
        default=[],
        dest="engine_client_namespaces",
        help="pods labelled serving.lockstep.dev/engine-client=true in this namespace may call "
        "engine HTTP (repeatable; default: such pods in any namespace)",
    )
    parser.add_argument(
        "--monitoring-namespace",
        action="append",
        default=[],
        dest="monitoring_namespaces",
        help="every pod of this namespace may call engine HTTP, e.g. Prometheus (repeatable)",
    )
    parser.add_argument("--autoscale-interval-seconds", type=float, default=5.0,
                        help="how often LLMServices with spec.autoscaling read their demand")  # fmt: skip
    parser.add_argument("--gateway-namespace", default="",
                        help="namespace of the gateway pods whose queue depth autoscaling reads")  # fmt: skip
    parser.add_argument("--gateway-selector", default="",
                        help="label selector of those gateway pods (empty: the gateway's queue is not read)")  # fmt: skip
    parser.add_argument("--gateway-metrics-port", type=int, default=8000, help="port of the gateways' /metrics")
    args = parser.parse_args(argv)
    try:
        return OperatorConfig(
            namespaces=tuple(args.namespaces),
            engine_image=args.engine_image,
            cluster_domain=args.cluster_domain,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            health_port=args.health_port,
            resync_seconds=args.resync_seconds,
            log_level=args.log_level,
            network_policy=args.network_policy,
            engine_client_namespaces=tuple(args.engine_client_namespaces),
            monitoring_namespaces=tuple(args.monitoring_namespaces),
            autoscale_interval_seconds=args.autoscale_interval_seconds,
            gateway_namespace=args.gateway_namespace,
            gateway_selector=args.gateway_selector,
            gateway_metrics_port=args.gateway_metrics_port,
        )
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def load_kube_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


async def _resync_forever(reconciler, interval: float) -> None:  # type: ignore[no-untyped-def]
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(reconciler.resync)
        except Exception:  # noqa: BLE001 - the next round tries again
            log.exception("periodic resync failed")


async def run(config: OperatorConfig) -> None:
    import kopf
    from prometheus_client import disable_created_metrics, start_http_server

    from lockstep_operator.handlers import build_registry, operator_settings
    from lockstep_operator.kube import Kube
    from lockstep_operator.metrics import REGISTRY
    from lockstep_operator.reconciler import Reconciler

    load_kube_config()
    disable_created_metrics()
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=REGISTRY)
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
    reconciler = Reconciler(Kube(), config)
    liveness = f"http://{config.metrics_host}:{config.health_port}/healthz" if config.health_port else None
    resync = asyncio.create_task(_resync_forever(reconciler, config.resync_seconds))
    try:
        await kopf.operator(
            registry=build_registry(reconciler),
            settings=operator_settings(),
            standalone=True,
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            liveness_endpoint=liveness,
        )
    finally:
        reconciler.queue.close()
        resync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await resync


def main(argv: list[str]) -> int:
    config = parse_args(argv)
    configure_logging("%(asctime)s %(levelname)s %(name)s: %(message)s", config.log_level)
    if config.log_level != "DEBUG":
        # kopf logs every handler call at INFO; ours only queue a reconcile, which logs its writes.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
