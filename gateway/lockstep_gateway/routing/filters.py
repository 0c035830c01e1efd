"""Filters: which engines may take a request at all. Each takes the candidates, the question and the
settings and returns the ones it keeps, in their order (the picker's random draws depend on it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lockstep_gateway.routing.candidate import Ask, Candidate, Settings, is_saturated

Filter = Callable[[Sequence[Candidate], Ask, Settings], list[Candidate]]


def serving_model(candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[Candidate]:
    """Healthy engines that serve the request's model."""
    return [c for c in candidates if c.healthy and ask.model in c.models]


def breaker_allows(candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[Candidate]:
    """Engines whose circuit breaker is closed, or half open and waiting for its probe."""
    return [c for c in candidates if c.breaker_allows]


def confident(candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[Candidate]:
    """Engines whose last health check answered in time; the suspect ones only when nothing else is left."""
    answering = [c for c in candidates if not c.suspect]
    return answering if answering else list(candidates)


def untried(candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[Candidate]:
    """Engines this request was not sent to yet (a retry goes elsewhere)."""
    return [c for c in candidates if c.url not in ask.tried]


def unsaturated(candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[Candidate]:
    """Engines with room: below `--saturation-queue-depth` and `--max-in-flight-per-engine`."""
    return [c for c in candidates
            if not is_saturated(c, settings.stale_after_s, settings.queue_depth, settings.max_in_flight)]


# Every policy's filters unless it names its own, in this order: `confident` decides among the engines
# that may serve, before `untried` and `unsaturated` narrow them (a suspect engine is not taken because the
# confident ones are busy).
DEFAULT_FILTERS: tuple[Filter, ...] = (serving_model, breaker_allows, confident, untried, unsaturated)
