"""The state behind each metric series: a spec (name, kind, help, labels, buckets), a classic histogram's
buckets, and the histograms and counters of one process keyed by name and label values. `metrics.py`
feeds them (the core's step timing, the API server's request latencies) and renders them."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # counter | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


class Buckets:
    """A classic histogram's state: per-bucket (not cumulative) counts, the last one +Inf, and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le semantics: value <= bound
        self.sum += value

    def observe_many(self, value: float, count: int) -> None:
        """`count` observations of one value."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def state(self) -> tuple[list[int], float]:
        return list(self.counts), self.sum


class Series:
    """Histograms and counters keyed by (name, label values)."""

    def __init__(self, specs: dict[str, Spec]):
        self.specs = specs
        self.histograms: dict[str, dict[tuple[str, ...], Buckets]] = {}
        self.counters: dict[str, dict[tuple[str, ...], float]] = {}

    def observe(self, name: str, labels: tuple[str, ...], value: float) -> None:
        self.buckets(name, labels).observe(value)

    def buckets(self, name: str, labels: tuple[str, ...]) -> Buckets:
        """The histogram state of one series, made on first use; callers on a hot path may keep it (it lives
        as long as the series)."""
        series = self.histograms.setdefault(name, {})
        buckets = series.get(labels)
        if buckets is None:
            buckets = series[labels] = Buckets(self.specs[name].buckets)
        return buckets

    def inc(self, name: str, labels: tuple[str, ...], amount: float) -> None:
        series = self.counters.setdefault(name, {})
        series[labels] = series.get(labels, 0.0) + amount
