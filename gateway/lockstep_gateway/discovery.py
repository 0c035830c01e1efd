"""Where engines come from: static URLs, a config file (re-read when it changes), or Kubernetes.

Kubernetes: the gateway lists and then watches the EndpointSlices of LLMService leader Services
(label `app.kubernetes.io/component=engine-leader`, which the EndpointSlice controller copies from
the Service) in each namespace it is given, or in all namespaces with one cluster-wide watch. Only endpoints that are ready and not terminating are
engines. A watch resumes from the last resourceVersion it saw (bookmarks keep that fresh); a 410
Gone (the version was compacted away) lists again from scratch. The parsing and the event folding
are pure functions; `KubernetesDiscovery` is the thin I/O shell around them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("lockstep.gateway")

SetEndpoints = Callable[[str, list[str]], None]
DeclareModels = Callable[[str, list[str]], None]
# The operator labels each leader Service with its served model; EndpointSlices carry Service labels.
SERVED_MODEL_LABEL = "serving.lockstep.dev/served-model-name"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ENGINE_PORT_NAME = "http"


# ---- static -----------------------------------------------------------------------------------
def read_config_file(path: str) -> list[str]:
    """`{"engines": ["http://host:port", ...]}` as JSON (or YAML when the name says so)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    engines = data.get("engines", []) if isinstance(data, dict) else None
    if not isinstance(engines, list) or not all(isinstance(e, str) and e.startswith(("http://", "https://"))
                                                 for e in engines):
        raise ValueError(f"{path}: 'engines' must be a list of http(s) URLs")
    return engines


async def watch_config_file(path: str, set_endpoints: SetEndpoints, interval_s: float = 2.0) -> None:
    """Apply the file now and again whenever its modification time changes; a broken edit keeps the
    engines of the last good version."""
    last_mtime = None
    while True:
        try:
            mtime = os.stat(path).st_mtime_ns
            if mtime != last_mtime:
                last_mtime = mtime
                set_endpoints(f"file:{path}", read_config_file(path))
        except (OSError, ValueError) as error:
            log.error("engine config %s: %s", path, error)
        await asyncio.sleep(interval_s)


# ---- Kubernetes: pure parts --------------------------------------------------------------------
def _format_host(address: str, address_type: str) -> str:
    return f"[{address}]" if address_type == "IPv6" or ":" in address else address


def slice_endpoints(endpoint_slice: dict[str, Any], port_name: str = ENGINE_PORT_NAME) -> list[str]:
    """The engine URLs of one EndpointSlice: ready and not terminating endpoints, on the named port."""
    address_type = endpoint_slice.get("addressType", "IPv4")
    if address_type not in ("IPv4", "IPv6"):
        return []
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None:
        return []
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        # Kubernetes: a nil `ready` means ready; `terminating` true means on the way out.
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for address in endpoint.get("addresses") or []:
            urls.append(f"http://{_format_host(address, address_type)}:{port}")
    return urls


def apply_event(slices: dict[str, list[str]], event: dict[str, Any]) -> str | None:
    """Fold one watch event into `slices` (slice name -> URLs). Returns the event's resourceVersion
    (None for an ERROR event, which the caller handles)."""
    kind = event.get("type")
    obj = event.get("object") or {}
    metadata = obj.get("metadata") or {}
    if kind == "ERROR":
        return None
    name = slice_key(obj)
    if kind in ("ADDED", "MODIFIED"):
        slices[name] = slice_endpoints(obj)
    elif kind == "DELETED":
        slices.pop(name, None)
    return metadata.get("resourceVersion")


def slice_model(endpoint_slice: dict[str, Any]) -> str | None:
    """The model the slice's Service serves, endpoints or not (a service scaled to zero has none)."""
    return ((endpoint_slice.get("metadata") or {}).get("labels") or {}).get(SERVED_MODEL_LABEL)


def slice_key(endpoint_slice: dict[str, Any]) -> str:
    """Slice names are unique per namespace only; a cluster-wide watch sees several namespaces."""
    metadata = endpoint_slice.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def endpoint_union(slices: dict[str, list[str]]) -> list[str]:
    return sorted({url for urls in slices.values() for url in urls})


class WatchExpired(Exception):
    """410 Gone: the resourceVersion is too old; list again."""


# ---- Kubernetes: I/O --------------------------------------------------------------------------
class KubeAPI:
    """Just enough of a Kubernetes client: base URL and TLS/auth from a kubeconfig or the pod's ServiceAccount."""

    def __init__(self, server: str, verify: ssl.SSLContext | bool, token: str | None, token_file: Path | None):
        self.server = server.rstrip("/")
        self.verify = verify
        self.token = token
        self.token_file = token_file

    def headers(self) -> dict[str, str]:
        token = self.token_file.read_text().strip() if self.token_file else self.token  # re-read: tokens rotate
        return {"Authorization": f"Bearer {token}"} if token else {}

    @classmethod
    def from_environment(cls, kubeconfig: str | None) -> KubeAPI:
        path = kubeconfig or os.environ.get("KUBECONFIG")
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not path and host:
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
            return cls(f"https://{_format_host(host, '')}:{port}", context, None, SERVICE_ACCOUNT_DIR / "token")
        if not path:
            path = str(Path.home() / ".kube" / "config")
        return cls.from_kubeconfig(path.split(os.pathsep)[0])

    @classmethod
    def from_kubeconfig(cls, path: str) -> KubeAPI:
        import yaml  # a kubeconfig is YAML (JSON is YAML too)

        config = yaml.safe_load(Path(path).read_text())
        context_name = config.get("current-context")
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        if cluster.get("insecure-skip-tls-verify"):
            verify: ssl.SSLContext | bool = False
        else:
            ca_data = cluster.get("certificate-authority-data")
            verify = ssl.create_default_context(cafile=cluster.get("certificate-authority"),
                                                cadata=base64.b64decode(ca_data).decode() if ca_data else None)
            certificate, key = _user_file(user, "client-certificate"), _user_file(user, "client-key")
            if certificate:
                verify.load_cert_chain(certificate, key)
        token_file = Path(user["tokenFile"]) if user.get("tokenFile") else None
        return cls(cluster["server"], verify, user.get("token"), token_file)


def _user_file(user: dict[str, Any], name: str) -> str | None:
    """A kubeconfig credential as a file path: `name` itself, or `name-data` (base64) written to a
    private temporary file, since `ssl` loads client certificates from files only."""
    if user.get(name):
        return user[name]
    data = user.get(f"{name}-data")
    if not data:
        return None
    handle, path = tempfile.mkstemp(prefix="lockstep-kube-")
    with os.fdopen(handle, "wb") as out:
        out.write(base64.b64decode(data))
    return path


class KubernetesDiscovery:
    """One list-then-watch loop over `namespace`, or over every namespace when it is None."""

    def __init__(self, api: KubeAPI, namespace: str | None, label_selector: str, set_endpoints: SetEndpoints,
                 retry_s: float = 1.0, declare_models: DeclareModels | None = None):
        self.api = api
        self.declare_models = declare_models
        self.models: dict[str, str] = {}  # slice -> the served model its Service's label names
        self.namespace = namespace
        self.label_selector = label_selector
        self.set_endpoints = set_endpoints
        self.retry_s = retry_s
        self.source = f"kubernetes:{namespace or '*'}"
        self.slices: dict[str, list[str]] = {}
        self.resource_version: str | None = None

    @property
    def path(self) -> str:
        if self.namespace is None:
            return "/apis/discovery.k8s.io/v1/endpointslices"
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.api.server, verify=self.api.verify,
                                     timeout=httpx.Timeout(10.0, read=None)) as client:
            while True:
                try:
                    if self.resource_version is None:
                        await self._list(client)
                    await self._watch(client)
                except WatchExpired:
                    log.info("%s: watch expired (410), listing again", self.source)
                    self.resource_version = None
                except (httpx.HTTPError, ValueError) as error:
                    log.warning("%s: %s; retrying in %.0fs", self.source, error or type(error).__name__,
                                self.retry_s)
                    await asyncio.sleep(self.retry_s)

    async def _list(self, client: httpx.AsyncClient) -> None:
        response = await client.get(self.path, params={"labelSelector": self.label_selector},
                                    headers=self.api.headers())
        response.raise_for_status()
        body = response.json()
        self.slices = {slice_key(item): slice_endpoints(item) for item in body.get("items", [])}
        self.models = {slice_key(item): model for item in body.get("items", []) if (model := slice_model(item))}
        self.resource_version = body["metadata"]["resourceVersion"]
        self._publish()

    async def _watch(self, client: httpx.AsyncClient) -> None:
        params = {"labelSelector": self.label_selector, "watch": "true", "allowWatchBookmarks": "true",
                  "resourceVersion": self.resource_version, "timeoutSeconds": "300"}
        async with client.stream("GET", self.path, params=params, headers=self.api.headers()) as response:
            if response.status_code == 410:
                raise WatchExpired()
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    if status.get("code") == 410:
                        raise WatchExpired()
                    raise ValueError(f"watch error: {status.get('message')}")
                changed = event.get("type") != "BOOKMARK"
                version = apply_event(self.slices, event) if changed else event["object"]["metadata"]["resourceVersion"]
                if changed and event.get("type") != "ERROR":
                    key, model = slice_key(event.get("object") or {}), slice_model(event.get("object") or {})
                    if event.get("type") == "DELETED" or model is None:
                        self.models.pop(key, None)
                    else:
                        self.models[key] = model
                if version:
                    self.resource_version = version
                if changed:
                    self._publish()

    def _publish(self) -> None:
        self.set_endpoints(self.source, endpoint_union(self.slices))
        if self.declare_models is not None:
            self.declare_models(self.source, sorted(set(self.models.values())))
