"""The engines the gateway knows: discovered endpoints, their health, models and load.

Discovery sources (static flags, a config file, Kubernetes) each own a set of URLs; an engine is
known while any source lists it. A known engine takes traffic only after an active health check
passed (`/health` 200, then `/v1/models` read for the model -> pool map); it is ejected at once when
it refuses connections or answers 503 (draining, not loaded), after `unhealthy_threshold` timed-out
checks, or when the proxy cannot connect to it, and readmitted after `healthy_threshold` passing
checks. Load gauges are scraped from `/metrics` on their own interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.engine_metrics import parse_engine_load
from lockstep_gateway.metrics import GatewayMetrics
from lockstep_gateway.routing import Candidate, EngineLoad

log = logging.getLogger("lockstep.gateway")


@dataclass(eq=False)
class Backend:
    url: str
    sources: set[str] = field(default_factory=set)
    models: tuple[str, ...] = ()
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    load: EngineLoad | None = None
    load_time: float = float("-inf")
    in_flight: int = 0
    tasks: list[asyncio.Task] = field(default_factory=list)

    def candidate(self, now: float) -> Candidate:
        return Candidate(self.url, self.in_flight, self.load, now - self.load_time)


class Registry:
    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient, metrics: GatewayMetrics):
        self.config = config
        self.client = client
        self.metrics = metrics
        self.backends: dict[str, Backend] = {}
        self.seen_models: set[str] = set()
        self._running = False

    # ---- discovery ----------------------------------------------------------------------------
    def set_endpoints(self, source: str, urls: Iterable[str]) -> None:
        """`source` now lists exactly `urls`; engines no source lists any more are forgotten."""
        wanted = {url.rstrip("/") for url in urls}
        for url in wanted:
            backend = self.backends.get(url)
            if backend is None:
                backend = self.backends[url] = Backend(url)
                log.info("engine %s discovered (%s)", url, source)
                if self._running:
                    self._watch(backend)
            backend.sources.add(source)
        for url, backend in list(self.backends.items()):
            if source in backend.sources and url not in wanted:
                backend.sources.discard(source)
                if not backend.sources:
                    self._forget(backend)

    def _forget(self, backend: Backend) -> None:
        log.info("engine %s removed", backend.url)
        for task in backend.tasks:
            task.cancel()
        del self.backends[backend.url]
        self.metrics.forget_engine(backend.url)

    # ---- what routing reads ---------------------------------------------------------------------
    def healthy(self, model: str | None = None) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy and (model is None or model in b.models)]

    def known_models(self) -> set[str]:
        """Every model an engine served since the gateway started: a down model is 503, not 404."""
        return set(self.seen_models)

    def any_unprobed(self) -> bool:
        """An engine that never passed a check may serve any model."""
        return any(not b.models for b in self.backends.values())

    def served_models(self) -> list[str]:
        names: dict[str, None] = {}
        for backend in self.backends.values():
            if backend.healthy:
                names.update(dict.fromkeys(backend.models))
        return list(names)

    # ---- health -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        for backend in self.backends.values():
            self._watch(backend)

    async def stop(self) -> None:
        self._running = False
        tasks = [t for b in self.backends.values() for t in b.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _watch(self, backend: Backend) -> None:
        backend.tasks = [asyncio.create_task(self._check_loop(backend)), asyncio.create_task(self._scrape_loop(backend))]

    def eject(self, backend: Backend, reason: str) -> None:
        backend.consecutive_successes = 0
        if backend.healthy:
            backend.healthy = False
            log.warning("engine %s ejected: %s", backend.url, reason)
            self.metrics.ejections.labels(backend.url).inc()
            self.metrics.upstream_healthy.labels(backend.url).set(0)

    def _admit(self, backend: Backend, models: tuple[str, ...]) -> None:
        backend.models = models
        self.seen_models.update(models)
        if not backend.healthy:
            backend.healthy = True
            log.info("engine %s admitted, serving %s", backend.url, list(models))
            self.metrics.upstream_healthy.labels(backend.url).set(1)

    async def _check_loop(self, backend: Backend) -> None:
        self.metrics.upstream_healthy.labels(backend.url).set(0)
        while True:
            try:
                await self.check(backend)
            except Exception as error:  # noqa: BLE001 - a dead check loop would keep a dead engine admitted
                log.exception("health check of %s failed unexpectedly", backend.url)
                self._fail(backend, f"health check error: {type(error).__name__}", definitive=False)
            await asyncio.sleep(self.config.health_check_interval_s)

    async def check(self, backend: Backend) -> None:
        """One active health check: /health, and /v1/models when the engine is (re)admitted."""
        timeout = self.config.health_check_timeout_s
        try:
            response = await self.client.get(backend.url + "/health", timeout=timeout)
            if response.status_code != 200:
                raise _Definitive(f"/health answered {response.status_code}")
            models = backend.models
            if not backend.healthy:
                listed = await self.client.get(backend.url + "/v1/models", timeout=timeout)
                if listed.status_code != 200:
                    raise _Definitive(f"/v1/models answered {listed.status_code}")
                models = tuple(m["id"] for m in listed.json().get("data", []))
        except httpx.TimeoutException:
            self._fail(backend, "health check timed out", definitive=False)
        except (httpx.HTTPError, _Definitive, ValueError, KeyError, TypeError) as error:
            self._fail(backend, str(error) or type(error).__name__, definitive=True)
        else:
            backend.consecutive_failures = 0
            backend.consecutive_successes += 1
            if backend.healthy or backend.consecutive_successes >= self.config.healthy_threshold:
                self._admit(backend, models)

    def _fail(self, backend: Backend, reason: str, definitive: bool) -> None:
        backend.consecutive_successes = 0
        backend.consecutive_failures += 1
        if definitive or backend.consecutive_failures >= self.config.unhealthy_threshold:
            self.eject(backend, reason)

    async def _scrape_loop(self, backend: Backend) -> None:
        while True:
            try:
                await self.scrape(backend)
            except Exception:  # noqa: BLE001 - keep scraping; stale load is ignored meanwhile
                log.exception("scraping the load of %s failed unexpectedly", backend.url)
            await asyncio.sleep(self.config.metrics_interval_s)

    async def scrape(self, backend: Backend) -> None:
        try:
            response = await self.client.get(backend.url + "/metrics", timeout=self.config.health_check_timeout_s)
            if response.status_code == 200:
                load = parse_engine_load(response.text)
                if load is not None:
                    backend.load, backend.load_time = load, time.monotonic()
        except httpx.HTTPError:
            pass  # the load goes stale and is ignored; health checks decide about ejection


class _Definitive(Exception):
    """A health check answer that needs no second opinion (refused, 503, bad body)."""
