"""LoRA affinity, as the Gateway API Inference Extension scores it: a request for an adapter goes to an
engine where the adapter is already running (its weights sit in a slot, no load before the first token),
else to one with a free adapter slot, rather than to one whose slots all hold other adapters (the request
waits there until one frees). The engine says which adapters run with vLLM's `vllm:lora_requests_info`
gauge (engine_metrics.py).

The preference holds while the engine's load is within a slack of the lightest engine's, as the prefix
scorer's does: past it nobody scores and load decides, so a hot adapter spreads over as many engines as
its load needs. Requests for a base model, and engines without a fresh scrape, score 0."""

from __future__ import annotations

from collections.abc import Sequence

from lockstep_gateway.routing.candidate import Ask, Candidate, Settings, load_score
from lockstep_gateway.routing.prefix import PREFIX_SLACK_ABS, PREFIX_SLACK_REL
from lockstep_gateway.routing.scorers import Scorer

RUNNING = 1.0
FREE_SLOT = 0.5


class LoraAffinity(Scorer):
    name = "lora-affinity"

    def score(self, candidates: Sequence[Candidate], ask: Ask, settings: Settings) -> list[float]:
        scores = [adapter_score(c, ask.model, settings.stale_after_s) for c in candidates]
        if not any(scores):
            return scores
        loads = [load_score(c, settings.stale_after_s) for c in candidates]
        lightest = min(loads)
        slack = max(lightest + PREFIX_SLACK_ABS, lightest * PREFIX_SLACK_REL)
        return [score if load <= slack else 0.0 for score, load in zip(scores, loads)]


def adapter_score(candidate: Candidate, model: str, stale_after_s: float) -> float:
    """RUNNING when the adapter has running requests on the engine, FREE_SLOT when fewer adapters run or
    wait there than it has slots (a waiting adapter takes the next free slot), else 0; 0 for a base model
    and without a fresh scrape."""
    load = candidate.load
    if model not in candidate.adapters or load is None or candidate.load_age_s > stale_after_s:
        return 0.0
    if model in load.running_adapters:
        return RUNNING
    if len(set(load.running_adapters).union(load.waiting_adapters)) < load.max_loras:
        return FREE_SLOT
    return 0.0
