"""What routing decides over: snapshots of the engines (`Candidate`), the request as routing sees it
(`Ask`), the settings every policy shares, and the load and saturation every policy uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineLoad:
    """An engine's load gauges at one scrape (vLLM's names)."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    # `vllm:lora_requests_info`: the adapter slots (--max-loras; 0 = LoRA off) and the adapters of the running
    # and the waiting requests.
    max_loras: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One engine as routing sees it at one instant (`Backend.candidate`)."""

    url: str
    in_flight: int = 0
    load: EngineLoad | None = None
    load_age_s: float = float("inf")
    # The gateway's open requests on the engine when `load` was scraped: requests sent since are
    # not in the scraped queue yet, so a burst counts at once and not one scrape later.
    in_flight_at_scrape: int = 0
    # The most requests the engine was seen running at once (its batch, as far as it filled); 0 before
    # any scrape.
    seats: int = 0
    models: tuple[str, ...] = ()  # base models and LoRA adapters
    healthy: bool = True
    suspect: bool = False  # its last health check timed out
    breaker_allows: bool = True  # its circuit breaker lets a request through now
    adapters: tuple[str, ...] = ()  # the names in `models` that are LoRA adapters


def load_score(candidate: Candidate, stale_after_s: float) -> float:
    """Lower is lighter. Scraped gauges older than `stale_after_s` are ignored (the engine may be gone)."""
    score = float(candidate.in_flight)
    load = candidate.load
    if load is not None and candidate.load_age_s <= stale_after_s:
        # Waiting requests count twice: they wait for the batch and then take a place in it.
        score = max(score, load.num_running + load.num_waiting) + load.num_waiting + load.kv_cache_usage
    return score


def is_saturated(candidate: Candidate, stale_after_s: float, queue_depth: int, max_in_flight: int) -> bool:
    """An engine takes no new request past either limit (0 = no limit). With a queue depth, this
    gateway also keeps at most the engine's seen batch plus that depth open on it: requests still in
    transit, or not yet parsed by a busy engine, are in no scraped queue, and a busy engine's scrapes
    go stale (a burst of 10,000 was all sent on, and ran the gateway out of file descriptors)."""
    if max_in_flight and candidate.in_flight >= max_in_flight:
        return True
    if not queue_depth:
        return False
    return candidate.in_flight >= candidate.seats + queue_depth \
        or predicted_waiting(candidate, stale_after_s) >= queue_depth


def predicted_waiting(candidate: Candidate, stale_after_s: float) -> float:
    """The engine's waiting queue now: the scraped count plus what this gateway sent since the
    scrape, less what ended since (each ended request lets a waiting one into the batch); 0 without
    a fresh scrape (then only `max_in_flight` bounds an engine)."""
    load = candidate.load
    if load is None or candidate.load_age_s > stale_after_s:
        return 0.0
    return max(0.0, load.num_waiting + candidate.in_flight - candidate.in_flight_at_scrape)


@dataclass(frozen=True)
class Settings:
    """The gateway settings routing reads (from `GatewayConfig`)."""

    stale_after_s: float = 3.0  # --metrics-stale
    queue_depth: int = 256  # --saturation-queue-depth (0 = no limit)
    max_in_flight: int = 0  # --max-in-flight-per-engine (0 = no limit)
    session_header: str = "x-session-id"
    session_affinity: bool = True


@dataclass(frozen=True)
class Incoming:
    """A client request at admission, for the scorers that read something of it (`Scorer.read`)."""

    model: str
    payload: Mapping
    headers: Mapping[str, str]
    generation: bool  # a completion, chat, response or message (not tokenize, count_tokens...)


@dataclass(frozen=True)
class Ask:
    """One routing question: an engine for this request, other than the ones already tried."""

    model: str
    hints: Mapping[str, object] = field(default_factory=dict)  # scorer name -> what it read at admission
    tried: frozenset[str] = frozenset()
    offered: tuple[str, ...] = ()  # every engine known, filtered or not, in any order (affinity's ring)
