"""The two guards that keep retries from multiplying a failure: a per-engine circuit breaker and a
gateway-wide retry budget. Plain state with the clock passed in, so tests need no sleeps.

* `CircuitBreaker`: `threshold` failed attempts in a row open it; while open the engine gets no
  requests; after `cooldown_s` it is half-open and lets one probe through: a success closes it, a
  failure opens it for another cool-down (Envoy's consecutive-5xx outlier detection). What counts
  as a failure is the proxy's call, as Envoy's: connection failures, resets, timeouts and 5xx
  answers; not a 503 the engine marks retryable (it refused the request unstarted, and another
  engine is tried), nor a 500 the engine marks as caused by the request
  (`X-Lockstep-Request-Fault`), which resets the count like a success.
* `RetryBudget`: retries in progress may not exceed `ratio` of the requests in progress, with a
  floor of `minimum` (Envoy's retry budget: 20 %, at least 3), so an outage never doubles the load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CircuitBreaker:
    threshold: int
    cooldown_s: float
    failures: int = 0
    open_until: float | None = None
    probing: bool = False

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def allows(self, now: float) -> bool:
        """Closed, or half-open with no probe out yet."""
        if self.open_until is None:
            return True
        return now >= self.open_until and not self.probing

    def on_attempt(self, now: float) -> None:
        """An attempt goes out; in the half-open state it is the probe."""
        if self.open_until is not None and now >= self.open_until:
            self.probing = True

    def on_success(self) -> None:
        self.failures = 0
        self.open_until = None
        self.probing = False

    def on_failure(self, now: float) -> bool:
        """Returns True when this failure opened the breaker."""
        self.failures += 1
        if self.probing or (self.open_until is None and self.failures >= self.threshold):
            self.open_until = now + self.cooldown_s
            self.probing = False
            return True
        return False


@dataclass
class RetryBudget:
    ratio: float
    minimum: int
    retrying: int = 0

    def allows(self, in_progress: int) -> bool:
        return self.retrying < max(self.minimum, self.ratio * in_progress)
