"""Discovery: EndpointSlice parsing and watch folding on plain data, the watch loop's 410 handling
against a scripted API, and the real thing against a real kube-apiserver + EndpointSlice controller."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from gateway_harness import MODEL, wait_for
from lockstep_gateway.discovery import (
    SERVED_MODEL_LABEL,
    KubeAPI,
    KubernetesDiscovery,
    apply_event,
    endpoint_union,
    read_config_file,
    slice_endpoints,
)

K8S_TESTS = Path(__file__).resolve().parents[1] / "k8s"


def _slice(name: str, endpoints: list[dict], port: int = 8000, address_type: str = "IPv4") -> dict:
    return {"metadata": {"name": name, "resourceVersion": "1"}, "addressType": address_type,
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}], "endpoints": endpoints}


def test_only_ready_and_not_terminating_endpoints_are_engines():
    endpoints = [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True, "terminating": False}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["10.0.0.4"], "conditions": {}},  # nil ready means ready
    ]
    assert slice_endpoints(_slice("s", endpoints)) == ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]
    ipv6 = _slice("s6", [{"addresses": ["fd00::5"], "conditions": {"ready": True}}], address_type="IPv6")
    assert slice_endpoints(ipv6) == ["http://[fd00::5]:8000"]
    assert slice_endpoints(_slice("f", [{"addresses": ["x.example"]}], address_type="FQDN")) == []
    assert slice_endpoints({**_slice("p", endpoints[:1]), "ports": None}) == []


def test_watch_events_fold_into_the_endpoint_set():
    slices: dict[str, list[str]] = {}
    ready = [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}]
    assert apply_event(slices, {"type": "ADDED", "object": _slice("a", ready)}) == "1"
    apply_event(slices, {"type": "ADDED", "object": _slice("b", ready, port=9000)})
    assert endpoint_union(slices) == ["http://10.0.0.1:8000", "http://10.0.0.1:9000"]
    apply_event(slices, {"type": "MODIFIED", "object": _slice("a", [])})
    apply_event(slices, {"type": "DELETED", "object": _slice("b", ready, port=9000)})
    assert endpoint_union(slices) == []


def test_config_file_lists_engines(tmp_path):
    path = tmp_path / "engines.json"
    path.write_text(json.dumps({"engines": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}))
    assert read_config_file(str(path)) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    path.write_text(json.dumps({"engines": ["10.0.0.1:8000"]}))
    with pytest.raises(ValueError, match="http"):
        read_config_file(str(path))


class ScriptedAPI:
    """A stand-in API server for what a real one will not do on demand: expire a watch (410 Gone)."""

    def __init__(self):
        self.lists = 0
        self.watches: list[str] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                query = self.path.split("?", 1)[1]
                if "watch=true" not in query:
                    api.lists += 1
                    ready = [{"addresses": [f"10.0.0.{api.lists}"], "conditions": {"ready": True}}]
                    body = {"metadata": {"resourceVersion": str(100 * api.lists)}, "items": [_slice("a", ready)]}
                    data = json.dumps(body).encode()
                    self.send_response(200)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                version = query.split("resourceVersion=")[1].split("&")[0]
                api.watches.append(version)
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                if version == "100":  # the first watch: one bookmark, then the version is gone
                    events = [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}}]
                elif version == "150":
                    events = [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}]
                else:
                    events = [{"type": "MODIFIED", "object": {**_slice("a", []), "metadata": {
                        "name": "a", "resourceVersion": "201"}}}]
                for event in events:
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                self.wfile.flush()
                self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_watch_resumes_from_bookmarks_and_lists_again_after_410():
    api = ScriptedAPI()
    published: list[list[str]] = []
    discovery = KubernetesDiscovery(KubeAPI(api.url, False, "token", None), "ns", "a=b",
                                    lambda source, urls: published.append(urls), retry_s=0.01)

    async def run():
        task = asyncio.create_task(discovery.run())
        deadline = time.monotonic() + 10
        while published[-1:] != [[]] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    api.server.shutdown()
    assert api.watches[:3] == ["100", "150", "200"]  # resumed from the bookmark; relisted after the 410
    assert api.lists == 2
    assert published[:3] == [["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"], []]


# ---- a real API server --------------------------------------------------------------------------
# The API server refuses loopback endpoint addresses, so the engine lives in a network namespace
# this test makes, joined to the host by a veth pair: the "pod IP" is an address inside it.
POD_ADDR, HOST_ADDR = "10.231.78.2", "10.231.78.1"
FAKE_IN_NAMESPACE = """
import sys
sys.path.insert(0, sys.argv[1])
from gateway_harness import FakeEngine
with FakeEngine([sys.argv[2]], behaviour="ok", host=sys.argv[3]) as fake:
    print(fake.port, flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def pod_engine():
    """A fake engine on POD_ADDR inside a fresh network namespace: (url, number of POSTs it got)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = uuid.uuid4().hex[:6]
    namespace, outside, inside = f"lsg{tag}", f"vga{tag}", f"vgb{tag}"
    process = None
    try:
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("addr", "add", f"{HOST_ADDR}/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("-n", namespace, "addr", "add", f"{POD_ADDR}/30", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        process = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c", FAKE_IN_NAMESPACE,
                                    str(Path(__file__).parent), MODEL, POD_ADDR],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port = int(process.stdout.readline())
        url = f"http://{POD_ADDR}:{port}"
        yield url, lambda: int(httpx.get(url + "/fake/posts", timeout=5).text)
    finally:
        if process is not None:
            process.stdin.close()
            process.wait(timeout=10)
        subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30, check=False)


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    sys.path.insert(0, str(K8S_TESTS))
    try:
        from k8s_harness import ControlPlane, binaries, kubectl_binary
    finally:
        sys.path.remove(str(K8S_TESTS))
    try:
        bins = binaries()
    except RuntimeError as error:
        pytest.skip(f"no Kubernetes control-plane binaries (make k8s-bins): {error}")
    plane = ControlPlane(tmp_path_factory.mktemp("kube"), bins)
    try:
        plane.start()
        plane.kubectl = kubectl_binary()
        yield plane
    finally:
        plane.stop()


def test_engines_are_discovered_from_endpointslices_of_a_real_api_server(control_plane, pod_engine, start_gateway):
    engine_url, num_posts = pod_engine
    address, port = POD_ADDR, int(engine_url.rsplit(":", 1)[1])
    env = {"KUBECONFIG": str(control_plane.kubeconfig)}

    def kubectl(*args: str, manifest: dict | None = None) -> str:
        result = subprocess.run([control_plane.kubectl, "-n", "llm", *args], input=json.dumps(manifest) if manifest
                                else None, capture_output=True, text=True, env=env, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def pod_ready(ready: bool) -> None:
        status = {"status": {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}],
                             "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        kubectl("patch", "pod", "svc-g0-0", "--subresource=status", "--type=merge", "-p", json.dumps(status))

    subprocess.run([control_plane.kubectl, "create", "namespace", "llm"], env=env, check=True, capture_output=True)
    # The EndpointSlice controller skips pods on nodes it does not know.
    kubectl("apply", "-f", "-", manifest={"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}})
    # What the operator builds: a leader Service labelled for LLMServices, selecting leader pods.
    kubectl("apply", "-f", "-", manifest={
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "svc", "labels": {"app.kubernetes.io/component": "engine-leader",
                                               "serving.lockstep.dev/service": "svc"}},
        "spec": {"selector": {"serving.lockstep.dev/service": "svc", "role": "leader"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}})
    kubectl("apply", "-f", "-", manifest={
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "svc-g0-0", "labels": {"serving.lockstep.dev/service": "svc", "role": "leader"},
                     "finalizers": ["test.lockstep.dev/hold"]},
        "spec": {"nodeName": "node-1", "containers": [{"name": "engine", "image": "registry.invalid/engine:0",
                                                       "ports": [{"name": "http", "containerPort": port}]}]}})
    gateway = start_gateway("--kubernetes-namespace=llm", f"--kubeconfig={control_plane.kubeconfig}")
    pod_ready(True)
    gateway.wait_engines({engine_url})
    response = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert response.status_code == 200 and num_posts() == 1
    everywhere = start_gateway("--kubernetes-all-namespaces", f"--kubeconfig={control_plane.kubeconfig}")
    everywhere.wait_engines({engine_url})  # one cluster-wide watch finds the namespace by itself

    pod_ready(False)  # readiness probe failing: out of rotation
    wait_for("the not-ready engine to leave", lambda: gateway.engines() == {}, timeout=30)
    pod_ready(True)
    gateway.wait_engines({engine_url})

    kubectl("delete", "pod", "svc-g0-0", "--wait=false")  # held by the finalizer: terminating
    wait_for("the terminating engine to leave", lambda: gateway.engines() == {}, timeout=30)
    kubectl("patch", "pod", "svc-g0-0", "--type=merge", "-p", '{"metadata": {"finalizers": null}}')


def test_kubeconfig_credentials_inline_or_as_files(tmp_path):
    import base64
    import ssl

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=t",
                    "-keyout", "key.pem", "-out", "cert.pem"], cwd=tmp_path, check=True, capture_output=True)
    data = {name: base64.b64encode((tmp_path / f"{name}.pem").read_bytes()).decode() for name in ("cert", "key")}
    config = {"current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
              "clusters": [{"name": "k", "cluster": {"server": "https://10.0.0.1:6443",
                                                     "certificate-authority-data": data["cert"]}}],
              "users": [{"name": "u", "user": {"client-certificate-data": data["cert"],
                                               "client-key-data": data["key"]}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    api = KubeAPI.from_kubeconfig(str(path))
    assert api.server == "https://10.0.0.1:6443" and isinstance(api.verify, ssl.SSLContext)
    assert api.headers() == {}
    config["users"][0]["user"] = {"token": "abc"}
    config["clusters"][0]["cluster"] = {"server": "https://10.0.0.1:6443",
                                        "certificate-authority": str(tmp_path / "cert.pem")}
    path.write_text(json.dumps(config))
    assert KubeAPI.from_kubeconfig(str(path)).headers() == {"Authorization": "Bearer abc"}


def test_a_service_with_no_engines_still_declares_its_model():
    """A leader Service scaled to zero has an EndpointSlice with no endpoints; its served-model label
    (copied from the Service) tells the gateway the model exists, so its requests wait in the queue."""

    class Lists(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if "watch=true" in self.path:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps({"type": "DELETED", "object": {**labelled("idle", []), "metadata": {
                    "name": "idle", "resourceVersion": "2", "labels": {SERVED_MODEL_LABEL: "smollm2"}}}}).encode() + b"\n")
                self.close_connection = True
                return
            body = {"metadata": {"resourceVersion": "1"}, "items": [labelled("idle", [])]}
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

    def labelled(name: str, endpoints: list[dict]) -> dict:
        item = _slice(name, endpoints)
        item["metadata"]["labels"] = {SERVED_MODEL_LABEL: "smollm2"}
        return item

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lists)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    declared: list[list[str]] = []
    discovery = KubernetesDiscovery(KubeAPI(f"http://127.0.0.1:{server.server_address[1]}", False, "t", None), "ns",
                                    "a=b", lambda source, urls: None, retry_s=0.01,
                                    declare_models=lambda source, names: declared.append(names))  # fmt: skip

    async def run():
        task = asyncio.create_task(discovery.run())
        deadline = time.monotonic() + 10
        while declared[-1:] != [[]] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    server.shutdown()
    assert declared[:2] == [["smollm2"], []]  # listed with no endpoints; forgotten when its slice goes
