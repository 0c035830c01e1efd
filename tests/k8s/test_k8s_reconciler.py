"""The reconcile queue and the error path, with a stand-in for the Kubernetes API."""

from __future__ import annotations

import threading

import pytest
from kubernetes.client.exceptions import ApiException

from k8s_harness import wait_for
from lockstep_operator import metrics
from lockstep_operator.config import OperatorConfig
from lockstep_operator.plan import Observed
from lockstep_operator.reconciler import Coalescer, Reconciler, scrape


def test_requests_during_a_run_fold_into_one_more_run():
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def work(key):
        runs.append(key)
        if len(runs) == 1:
            started.set()
            release.wait(5)

    queue = Coalescer(work)
    first = threading.Thread(target=queue.request, args=("a",))
    first.start()
    assert started.wait(5)
    for _ in range(10):
        queue.request("a")  # returns at once: "a" is running
    release.set()
    first.join(5)
    assert runs == ["a", "a"]


def test_a_failed_run_is_retried_after_a_delay():
    calls: list[float] = []
    done = threading.Event()

    def work(key):
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("API server unavailable")
        done.set()

    queue = Coalescer(work, retry_delays=(0.05,))
    queue.request("a")
    assert done.wait(5)
    assert calls == ["a", "a"]


class FakeKube:
    def __init__(self, owner, error=None):
        self.owner = owner
        self.error = error
        self.statuses: list[dict] = []
        self.events: list = []

    def get_service(self, namespace, name):
        return self.owner

    def observe(self, owner):
        if self.error:
            raise self.error
        return Observed()

    def execute(self, namespace, plan):
        pass

    def patch_status(self, namespace, name, status):
        self.statuses.append(status)

    @property
    def core(self):
        return self

    def create_namespaced_event(self, namespace, event):
        self.events.append(event)


OWNER = {
    "metadata": {"name": "llama", "namespace": "prod", "uid": "u", "generation": 4},
    "spec": {"model": {"source": "smollm2"}},
    "status": {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllGroupsReady", "lastTransitionTime": "t0"}
        ]
    },
}


def test_a_failing_reconcile_counts_an_error_and_says_so_in_status():
    kube = FakeKube(OWNER, error=ApiException(status=500, reason="etcdserver: request timed out"))
    reconciler = Reconciler(kube, OperatorConfig(), clock=lambda: "t1")  # type: ignore[arg-type]
    errors = metrics.RECONCILE_ERRORS._value.get()
    with pytest.raises(ApiException):
        reconciler.reconcile("prod", "llama")
    assert metrics.RECONCILE_ERRORS._value.get() == errors + 1
    (status,) = kube.statuses
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReconcileError")
    assert "etcdserver: request timed out" in degraded["message"]
    # What was known before stays: Ready is not flipped by an error of the operator itself.
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["lastTransitionTime"] == "t0"


def test_a_namespace_being_deleted_is_not_an_error():
    body = '{"message": "namespace t-1 is being terminated", "details": {"causes": [{"reason": "NamespaceTerminating"}]}}'
    error = ApiException(status=403, reason="Forbidden")
    error.body = body
    kube = FakeKube(OWNER, error=error)
    reconciler = Reconciler(kube, OperatorConfig(), clock=lambda: "t1")  # type: ignore[arg-type]
    errors = metrics.RECONCILE_ERRORS._value.get()
    reconciler.reconcile("prod", "llama")  # returns: nothing to retry
    assert metrics.RECONCILE_ERRORS._value.get() == errors
    assert kube.statuses == []


def test_a_reconcile_counts_and_times_itself():
    kube = FakeKube(OWNER)
    reconciler = Reconciler(kube, OperatorConfig(), clock=lambda: "t1")  # type: ignore[arg-type]
    reconciles = metrics.RECONCILES._value.get()
    observed = metrics.RECONCILE_DURATION._sum.get()
    reconciler.reconcile("prod", "llama")
    assert metrics.RECONCILES._value.get() == reconciles + 1
    assert metrics.RECONCILE_DURATION._sum.get() > observed
    assert kube.statuses and kube.statuses[0]["observedGeneration"] == 4


def test_wait_for_reports_the_last_value_at_the_deadline():
    with pytest.raises(AssertionError, match="waiting for nothing; last: 0"):
        wait_for("nothing", lambda: 0, timeout=0.05, interval=0.01)


def test_an_unreadable_gateway_queue_is_a_warning_once_until_it_answers_again(caplog):
    import http.server

    failing: set[str] = set()
    closed = "http://127.0.0.1:9/metrics"  # the discard port: nothing listens on loopback there
    with caplog.at_level("INFO", logger="lockstep_operator.reconciler"):
        assert scrape(closed, timeout=1, failing=failing) == ""
        assert scrape(closed, timeout=1, failing=failing) == ""
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cannot read the gateway's queue depth" in warnings[0].getMessage()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = b'lockstep_gateway_queue_depth{model="m"} 2\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    failing.add(url)
    with caplog.at_level("INFO", logger="lockstep_operator.reconciler"):
        assert "queue_depth" in scrape(url, timeout=5, failing=failing)
    server.server_close()
    assert url not in failing
    assert any("again" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
