"""One reconcile of one LLMService, and the queue that keeps reconciles of one object serial.

Everything that happens to an LLMService or its children ends up as `request(namespace, name)`.
Requests that arrive while that object is being reconciled fold into one more pass, so a burst
of pod events costs a couple of passes, never one per event and never two at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Hashable, Sequence
from datetime import datetime, timezone

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep_common import metrics_names as n
from lockstep_common import vllm_metrics as v
from lockstep_operator import metrics
from lockstep_operator.autoscale import Demand, desired_replicas, gauge_sum
from lockstep_operator.conditions import error_status, status_changed
from lockstep_operator.config import OperatorConfig
from lockstep_operator.constants import API_VERSION, ENGINE_PORT, KIND, LABEL_POD_INDEX, MANAGED_BY
from lockstep_operator.groups import is_pod_ready, labels_of
from lockstep_operator.kube import Kube
from lockstep_operator.plan import Observed, Plan, plan_reconcile
from lockstep_operator.spec import SpecError, parse_spec

log = logging.getLogger(__name__)


def going_away(error: ApiException) -> bool:
    """The LLMService or its namespace is being deleted: the failure needs no retry."""
    return error.status == 404 or (error.status == 403 and "NamespaceTerminating" in str(error.body))


def _api_message(error: ApiException) -> str:
    if not error.body:
        return ""
    try:
        return json.loads(error.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(error.body)[:500]


def scrape(url: str, timeout: float = 2.0, failing: set[str] | None = None) -> str:
    """A /metrics page, or "" when it cannot be read (a pod going away counts as no demand). With
    `failing` (the URLs that failed last time), a failure is a warning, once until the URL answers again."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError) as error:
        if failing is None:
            log.debug("could not read %s: %s", url, error)
        elif url not in failing:
            failing.add(url)
            log.warning("cannot read the gateway's queue depth from %s (%s): requests queued there do not count "
                        "for autoscaling, so a service at zero groups is not started (a NetworkPolicy in the way?)",
                        url, error)  # fmt: skip
        return ""
    if failing is not None and url in failing:
        failing.discard(url)
        log.info("reading the gateway's queue depth from %s again", url)
    return text


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Coalescer:
    """Runs `work(key)`, one run per key at a time; failures are retried with backoff."""

    def __init__(
        self, work: Callable[[Hashable], None], retry_delays: Sequence[float] = (1, 2, 5, 10, 30)
    ) -> None:
        self._work = work
        self._retry_delays = tuple(retry_delays)
        self._lock = threading.Lock()
        self._running: set[Hashable] = set()
        self._pending: set[Hashable] = set()
        self._failures: dict[Hashable, int] = {}
        self._closed = False

    def request(self, key: Hashable) -> None:
        with self._lock:
            if self._closed:
                return
            if key in self._running:
                self._pending.add(key)
                return
            self._running.add(key)
        while True:
            self._run_once(key)
            with self._lock:
                if key in self._pending and not self._closed:
                    self._pending.discard(key)
                    continue
                self._running.discard(key)
                return

    def _run_once(self, key: Hashable) -> None:
        try:
            self._work(key)
        except Exception:  # noqa: BLE001 - one object's failure must not stop the others
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
            delay = self._retry_delays[min(failures, len(self._retry_delays) - 1)]
            log.exception("reconcile of %s failed; retrying in %ss", key, delay)
            timer = threading.Timer(delay, self.request, args=(key,))
            timer.daemon = True
            timer.start()
        else:
            self._failures.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig, clock: Callable[[], str] = utc_now) -> None:
        self.kube = kube
        self.config = config
        self.clock = clock
        self.queue = Coalescer(self._reconcile_key)
        self._timers: dict[tuple[str, str], threading.Timer] = {}
        self._timers_lock = threading.Lock()
        self._failing_gateways: set[str] = set()  # gateway /metrics URLs whose last read failed

    def request(self, namespace: str, name: str) -> None:
        self.queue.request((namespace, name))

    def request_later(self, namespace: str, name: str, seconds: float) -> None:
        """One reconcile of the object after `seconds` (the latest request replaces an earlier one)."""
        key = (namespace, name)
        timer = threading.Timer(seconds, self.request, args=key)
        timer.daemon = True
        with self._timers_lock:
            previous = self._timers.pop(key, None)
            if previous is not None:
                previous.cancel()
            self._timers[key] = timer
        timer.start()

    def resync(self) -> None:
        for namespace, name in self.kube.list_services(self.config.namespaces):
            self.request(namespace, name)

    def _reconcile_key(self, key: Hashable) -> None:
        namespace, name = key  # type: ignore[misc]
        self.reconcile(namespace, name)

    def reconcile(self, namespace: str, name: str) -> None:
        metrics.RECONCILES.inc()
        start = time.perf_counter()
        owner = None
        try:
            owner = self.kube.get_service(namespace, name)
            if owner is None or owner["metadata"].get("deletionTimestamp"):
                return  # garbage collection removes the children through their owner references
            observed = self.kube.observe(owner)
            now = self.clock()
            plan = plan_reconcile(owner, observed, self.config, now)
            self.kube.execute(namespace, plan)
            self._autoscale(owner, observed, plan, now)
            metrics.GROUP_RESTARTS.inc(plan.group_restarts)
            metrics.GROUP_UPDATES.inc(plan.group_updates)
            for type_, reason, message in plan.events:
                self.post_event(owner, type_, reason, message)
            if status_changed(owner.get("status"), plan.status):
                self.kube.patch_status(namespace, name, plan.status)
            if plan.requeue_after is not None:
                self.request_later(namespace, name, plan.requeue_after + 0.5)
        except ApiException as error:
            if going_away(error):
                log.info("%s/%s or its namespace is being deleted; nothing to reconcile", namespace, name)
                return
            self._fail(owner, f"{error.status} {error.reason}: {_api_message(error)}")
            raise
        except Exception as error:
            self._fail(owner, f"{type(error).__name__}: {error}")
            raise
        finally:
            metrics.RECONCILE_DURATION.observe(time.perf_counter() - start)

    def _autoscale(self, owner: dict, observed: Observed, plan: Plan, now: str) -> None:
        """spec.autoscaling: read the demand, write spec.replicas through /scale when it changes."""
        meta = owner["metadata"]
        try:
            spec = parse_spec(meta["name"], owner.get("spec") or {}, default_image=self.config.engine_image)
        except SpecError:
            return  # the plan reported it
        if spec.autoscaling is None or not plan.status:
            return
        demand = self.demand(meta["namespace"], spec.served_name, observed)
        previous = (owner.get("status") or {}).get("autoscaling")
        settled = plan.status.get("readyReplicas", 0) >= spec.replicas and plan.status.get("replicas") == spec.replicas
        desired, autoscaling = desired_replicas(
            spec.replicas, demand, spec.autoscaling, previous, now, settled=settled
        )
        # Status is written as a merge patch: a key the new status drops (quietSince, once demand is
        # back) must be sent as null, or the old one stays and the next delay is counted from it.
        for dropped in (previous or {}).keys() - autoscaling.keys():
            autoscaling[dropped] = None
        plan.status["autoscaling"] = autoscaling
        if desired != spec.replicas:
            self.kube.scale(meta["namespace"], meta["name"], desired)
            plan.events.append(("Normal", "Scaled", f"scaled from {spec.replicas} to {desired} groups: "
                                f"{demand.waiting:.0f} waiting, {demand.running:.0f} running, "
                                f"{demand.queued:.0f} queued in the gateway"))  # fmt: skip
        plan.requeue(self.config.autoscale_interval_seconds)

    def demand(self, namespace: str, served_name: str, observed: Observed) -> Demand:
        """Requests waiting and running in the ready leaders, and queued for the model in the gateways."""
        waiting = running = queued = 0.0
        for pod in observed.pods:
            ip = (pod.get("status") or {}).get("podIP")
            if labels_of(pod).get(LABEL_POD_INDEX) != "0" or not ip or not is_pod_ready(pod):
                continue
            text = scrape(f"http://{ip}:{ENGINE_PORT}/metrics")
            waiting += gauge_sum(text, v.NUM_REQUESTS_WAITING)
            running += gauge_sum(text, v.NUM_REQUESTS_RUNNING)
        if self.config.gateway_selector:
            try:
                gateways = self.kube.pod_ips(self.config.gateway_namespace or namespace, self.config.gateway_selector)
            except ApiException as error:  # e.g. no Role in the gateway's namespace: the engines still count
                log.warning("cannot list the gateway pods for autoscaling: %s %s", error.status, error.reason)
                gateways = []
            for ip in gateways:
                text = scrape(f"http://{ip}:{self.config.gateway_metrics_port}/metrics", failing=self._failing_gateways)
                queued += gauge_sum(text, n.GATEWAY_QUEUE_DEPTH, {"model": served_name})
        return Demand(waiting=waiting, running=running, queued=queued)

    def _fail(self, owner: dict | None, message: str) -> None:
        metrics.RECONCILE_ERRORS.inc()
        if owner is None:
            return
        meta = owner["metadata"]
        try:
            self.kube.patch_status(
                meta["namespace"], meta["name"], error_status(owner, message[:1000], self.clock())
            )
        except Exception:  # noqa: BLE001 - the original error is what gets raised
            log.warning(
                "could not record the reconcile error in the status of %s/%s", meta["namespace"], meta["name"]
            )

    def post_event(self, owner: dict, type_: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        now = datetime.now(timezone.utc)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION,
                kind=KIND,
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta["uid"],
            ),
            type=type_,
            reason=reason,
            message=message,
            source=client.V1EventSource(component=MANAGED_BY),
            reporting_component=MANAGED_BY,
            reporting_instance=MANAGED_BY,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self.kube.core.create_namespaced_event(meta["namespace"], event)
        except ApiException as error:
            log.warning(
                "could not post event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], error.reason
            )
