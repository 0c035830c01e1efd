"""The engines the gateway knows: discovered endpoints, their health, models and load.

Discovery sources (static flags, a config file, Kubernetes) each own a set of URLs; an engine is
known while any source lists it. A known engine takes traffic only after an active health check
passed (`/health` 200, then `/v1/models` read for the model -> pool map and each model's context
length). Busy is not dead: a check that answers 200, however slowly within the timeout, passes; a
timed-out check makes the engine *suspect* (no new requests while another engine can take them),
and only `unhealthy_threshold` timed-out checks in a row eject it. An unresponsive engine's
requests still waiting for their first byte are then ended (they are not replayed: the engine may
have started them). A refused connection, or a check answered non-200 (503: loading, draining or
a dead core) ejects at once; such an engine finishes or fails its own requests. Ejected engines are
readmitted after `healthy_threshold` passing checks. Load gauges are scraped from `/metrics` on
their own interval. An engine with LoRA adapter slots (`max_lora` above 0 in its scrape) may load and
unload adapters at run time: its `/v1/models` is read again after each such scrape (entries with a
`parent` are its adapters). Checks and scrapes carry the engine key when one is configured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from lockstep_gateway.breaker import CircuitBreaker
from lockstep_gateway.config import GatewayConfig
from lockstep_gateway.engine_metrics import parse_engine_load
from lockstep_gateway.metrics import GatewayMetrics
from lockstep_gateway.routing.candidate import Candidate, EngineLoad

log = logging.getLogger("lockstep.gateway")


@dataclass(eq=False)
class Backend:
    url: str
    sources: set[str] = field(default_factory=set)
    models: tuple[str, ...] = ()  # base models first, then LoRA adapters, as /v1/models lists them
    adapters: tuple[str, ...] = ()  # the names in `models` that are LoRA adapters (a `parent` in their entry)
    max_model_len: dict[str, int] = field(default_factory=dict)
    cards: dict[str, dict] = field(default_factory=dict)  # model -> its /v1/models entry, as the engine wrote it
    healthy: bool = False
    suspect: bool = False  # the last check timed out: new requests go elsewhere if they can
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_failure: str | None = None  # logged when it changes, so a never-admitted engine says why once
    load: EngineLoad | None = None
    load_time: float = float("-inf")
    in_flight_at_scrape: int = 0
    seats: int = 0  # the most requests it was seen running at once (routing.candidate.Candidate.seats)
    in_flight: int = 0
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(5, 5.0))
    # Resolved when the engine is ejected as unresponsive: attempts waiting for a first byte end.
    unresponsive: asyncio.Future | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)

    def candidate(self, now: float) -> Candidate:
        return Candidate(self.url, self.in_flight, self.load, now - self.load_time, self.in_flight_at_scrape,
                         self.seats, self.models, self.healthy, self.suspect, self.breaker.allows(now),
                         self.adapters)

    def set_cards(self, cards: dict[str, dict]) -> None:
        """The engine's /v1/models entries by name: its models, adapters and context lengths."""
        self.cards = cards
        self.models = tuple(cards)
        self.adapters = tuple(name for name, card in cards.items() if card.get("parent"))
        self.max_model_len = {name: card["max_model_len"] for name, card in cards.items()
                              if isinstance(card.get("max_model_len"), int)}

    def unresponsive_signal(self) -> asyncio.Future:
        if self.unresponsive is None or self.unresponsive.done():
            self.unresponsive = asyncio.get_running_loop().create_future()
        return self.unresponsive


class Registry:
    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient, metrics: GatewayMetrics):
        self.config = config
        self.client = client
        self.metrics = metrics
        self.backends: dict[str, Backend] = {}
        self.seen_models: set[str] = set()
        # Models that exist even with no engine up (source -> names; e.g. an LLMService at zero replicas):
        # their requests wait in the queue instead of getting 404.
        self.declared_models: dict[str, set[str]] = {}
        # Called with (backend, event) when an engine may have room or lost its state: "admitted" (it became
        # healthy: new, or back after an ejection, maybe restarted), "checked" (a health check passed),
        # "load" (a fresh scrape), "removed" (no source lists it any more).
        self.listeners: list[Callable[[Backend, str], None]] = []
        self.headers = {"authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else {}
        self._running = False

    # ---- discovery ----------------------------------------------------------------------------
    def set_endpoints(self, source: str, urls: Iterable[str]) -> None:
        """`source` now lists exactly `urls`; engines no source lists any more are forgotten."""
        wanted = {url.rstrip("/") for url in urls}
        for url in wanted:
            backend = self.backends.get(url)
            if backend is None:
                backend = self.backends[url] = Backend(url, breaker=CircuitBreaker(
                    self.config.breaker_failures, self.config.breaker_cooldown_s))
                log.info("engine %s discovered (%s)", url, source)
                if self._running:
                    self._watch(backend)
            backend.sources.add(source)
        for url, backend in list(self.backends.items()):
            if source in backend.sources and url not in wanted:
                backend.sources.discard(source)
                if not backend.sources:
                    self._forget(backend)

    def declare_models(self, source: str, names: Iterable[str]) -> None:
        """`source` now says exactly `names` exist, whether or not an engine serves them yet."""
        self.declared_models[source] = set(names)

    def _forget(self, backend: Backend) -> None:
        log.info("engine %s removed", backend.url)
        for task in backend.tasks:
            task.cancel()
        del self.backends[backend.url]
        self.metrics.forget_engine(backend.url)
        self._notify(backend, "removed")

    def _notify(self, backend: Backend, event: str) -> None:
        for listener in self.listeners:
            listener(backend, event)

    # ---- what routing reads ---------------------------------------------------------------------
    def healthy(self, model: str | None = None) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy and (model is None or model in b.models)]

    def known_models(self) -> set[str]:
        """Every model an engine served since the gateway started, every declared one, and the adapters
        engines list now (down or not): their requests wait for an engine instead of getting 404. An
        adapter unloaded from every engine is unknown again."""
        adapters = (backend.adapters for backend in self.backends.values())
        return self.seen_models.union(*self.declared_models.values(), *adapters)

    def any_unprobed(self) -> bool:
        """An engine that never passed a check may serve any model."""
        return any(not b.models for b in self.backends.values())

    def max_model_len(self, model: str) -> int | None:
        """The smallest context length an engine serving `model` reported (None when none did)."""
        lengths = [b.max_model_len[model] for b in self.backends.values() if model in b.max_model_len]
        return min(lengths) if lengths else None

    def model_card(self, model: str) -> dict | None:
        """`model`'s /v1/models entry as a healthy engine reported it, with the smallest context length
        of any engine serving it; None when no healthy engine serves it."""
        serving = self.healthy(model)
        if not serving:
            return None
        card = dict(serving[0].cards.get(model) or {"id": model, "object": "model", "owned_by": "lockstep"})
        if self.max_model_len(model) is not None:
            card["max_model_len"] = self.max_model_len(model)
        return card

    def served_models(self, adapters: bool = True) -> list[str]:
        names: dict[str, None] = {}
        for backend in self.backends.values():
            if backend.healthy:
                names.update(dict.fromkeys(m for m in backend.models if adapters or m not in backend.adapters))
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

    def eject(self, backend: Backend, reason: str, unresponsive: bool = False) -> None:
        backend.consecutive_successes = 0
        if unresponsive and backend.unresponsive is not None and not backend.unresponsive.done():
            backend.unresponsive.set_result(reason)
        if backend.healthy:
            backend.healthy = False
            log.warning("engine %s ejected: %s", backend.url, reason)
            self.metrics.ejections.labels(backend.url).inc()
            self.metrics.upstream_healthy.labels(backend.url).set(0)

    def _admit(self, backend: Backend, cards: dict[str, dict] | None) -> None:
        if cards is not None:
            self._set_cards(backend, cards)
        backend.suspect = False
        if not backend.healthy:
            backend.healthy = True
            log.info("engine %s admitted, serving %s", backend.url, list(backend.models))
            self.metrics.upstream_healthy.labels(backend.url).set(1)
            self._notify(backend, "admitted")
        else:
            self._notify(backend, "checked")

    async def _check_loop(self, backend: Backend) -> None:
        self.metrics.upstream_healthy.labels(backend.url).set(0)
        while True:
            try:
                await self.check(backend)
            except Exception as error:
                log.exception("health check of %s failed unexpectedly", backend.url)
                self._fail(backend, f"health check error: {type(error).__name__}", definitive=False)
            await asyncio.sleep(self.config.health_check_interval_s)

    async def check(self, backend: Backend) -> None:
        """One active health check: /health, and /v1/models when the engine is (re)admitted."""
        timeout = self.config.health_check_timeout_s
        try:
            # A connection of its own per check, as a kubelet's: the engine answers /health on a new connection
            # off its event loop, and one that served /metrics or /v1/models before is the loop's.
            response = await self.client.get(backend.url + "/health", timeout=timeout,
                                             headers={**self.headers, "connection": "close"})
            if response.status_code != 200:
                raise _Definitive(f"/health answered {response.status_code}")
            cards = None if backend.healthy else await self.read_cards(backend)
        except httpx.TimeoutException:
            self._fail(backend, f"{self.config.unhealthy_threshold} health checks in a row got no answer within "
                                f"{timeout:g}s", definitive=False)
        except (httpx.HTTPError, _Definitive, ValueError, KeyError, TypeError) as error:
            self._fail(backend, str(error) or type(error).__name__, definitive=True)
        else:
            backend.consecutive_failures = 0
            backend.consecutive_successes += 1
            backend.last_failure = None
            if backend.healthy or backend.consecutive_successes >= self.config.healthy_threshold:
                self._admit(backend, cards)

    async def read_cards(self, backend: Backend) -> dict[str, dict]:
        """The engine's /v1/models entries by name, in its order."""
        listed = await self.client.get(backend.url + "/v1/models", timeout=self.config.health_check_timeout_s,
                                       headers=self.headers)
        if listed.status_code != 200:
            hint = " (give the gateway the engine's key: --engine-api-key-file)" if listed.status_code == 401 else ""
            raise _Definitive(f"/v1/models answered {listed.status_code}{hint}")
        return {m["id"]: m for m in listed.json().get("data", [])}

    def _set_cards(self, backend: Backend, cards: dict[str, dict]) -> None:
        before = (backend.models, backend.adapters)
        backend.set_cards(cards)
        self.seen_models.update(m for m in backend.models if m not in backend.adapters)
        if backend.healthy and (backend.models, backend.adapters) != before:
            log.info("engine %s now serves %s (adapters: %s)", backend.url, list(backend.models), list(backend.adapters))
            self._notify(backend, "models")

    def _fail(self, backend: Backend, reason: str, definitive: bool) -> None:
        backend.consecutive_successes = 0
        backend.consecutive_failures += 1
        if definitive:
            if not backend.healthy and reason != backend.last_failure:
                log.info("engine %s not admitted: %s", backend.url, reason)
            backend.last_failure = reason
            self.eject(backend, reason)
            return
        if backend.healthy and not backend.suspect:
            log.info("engine %s is slow to answer its health check: no new requests while others can take them",
                     backend.url)
        backend.suspect = True
        if backend.consecutive_failures >= self.config.unhealthy_threshold:
            self.eject(backend, reason, unresponsive=True)

    async def _scrape_loop(self, backend: Backend) -> None:
        while True:
            try:
                await self.scrape(backend)
            except Exception:
                log.exception("scraping the load of %s failed unexpectedly", backend.url)
            await asyncio.sleep(self.config.metrics_interval_s)

    async def scrape(self, backend: Backend) -> None:
        try:
            response = await self.client.get(backend.url + "/metrics", timeout=self.config.health_check_timeout_s,
                                             headers=self.headers)
            if response.status_code == 200:
                load = parse_engine_load(response.text)
                if load is not None:
                    backend.load, backend.load_time = load, time.monotonic()
                    backend.in_flight_at_scrape = backend.in_flight
                    backend.seats = max(backend.seats, int(load.num_running))
                    self._notify(backend, "load")
                    if load.max_loras and backend.healthy:  # adapters come and go at run time
                        self._set_cards(backend, await self.read_cards(backend))
        except (httpx.HTTPError, _Definitive, ValueError, KeyError, TypeError):
            pass  # the load goes stale and is ignored, the models stay; health checks decide about ejection


class _Definitive(Exception):
    """A health check answer that needs no second opinion (refused, 503, bad body)."""
