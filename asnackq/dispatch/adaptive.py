"""Adaptive concurrency: how many sends a run keeps in flight, found from the sink's answers.

The rule is AIMD (additive increase, multiplicative decrease) whose increase follows CUBIC's
curve (RFC 9438), with a latency guard:

* Each send ends as ``ok`` (any answer from the sink but an overload), ``overload`` (429,
  or 503 with ``Retry-After``) or ``failure`` (the sink did not answer: refused, reset,
  timed out).
* Slow start: until the first cut, each ``ok`` send that found the limit in use adds one
  (the limit doubles per round trip).
* An overload, a failure, or a smoothed latency above ``TOLERANCE`` times the latency floor
  (the least latency seen, drifting slowly up so that a sink that became slower for good
  is learnt) cuts the limit to ``DECREASE`` times itself - at most once per round trip:
  a send that began before the last cut does not cut again.  The limit it had is
  remembered (``w_max``).
* After a cut, each ``ok`` send that found the limit in use moves the limit towards
  ``w_max + CUBIC * (t - k) ** 3``, ``t`` the seconds since the cut and ``k`` the seconds
  the curve takes back to ``w_max``: quickly back to just below the limit that was too
  much, then a plateau there, then faster again past it.  The probes past a known limit,
  each of which costs a 429 (and, with ``Retry-After: 1``, a second of that job's
  latency), come about once every ``k`` seconds (1.6 s for a limit of 4), however short
  the round trip; growth is at most one per round trip.
* Never below ``min_limit``, never above ``max_limit``.

No I/O and no event loop: the clock (seconds, monotonic) is injected, the samples come in
as arguments.  ``asnackq.dispatch.gate`` holds the sends to the limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["CUBIC", "DECREASE", "TOLERANCE", "Aimd", "Outcome"]

Outcome = Literal["ok", "overload", "failure"]
CUBIC = 0.2  # the curve's scale: slots a second cubed (RFC 9438's C)
DECREASE = 0.8  # the limit kept at a cut
TOLERANCE = 2.0  # smoothed latency over floor that counts as a queue building up
SLACK_S = 0.002  # latency above the floor never counted as a queue (timer noise)
SMOOTHING = 0.1  # weight of a new sample in the smoothed latency
FLOOR_DRIFT = 0.001  # how fast the floor follows latencies above it


@dataclass
class Aimd:
    """The current concurrency limit, moved by each send's outcome and latency."""

    max_limit: int
    clock: Callable[[], float]
    initial: int = 1
    min_limit: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(
                "the limits must be 1 <= min_limit <= initial <= max_limit: "
                f"{self.min_limit}, {self.initial}, {self.max_limit}"
            )
        self.value = float(self.initial)
        self.slow_start = True
        self.cut_at = -math.inf  # the clock's reading at the last cut
        self.w_max = self.value  # the limit before the last cut
        self.k_s = 0.0  # seconds from the last cut until the curve is back at w_max
        self.floor_s = math.inf
        self.smoothed_s = 0.0
        self.cuts = 0

    @property
    def limit(self) -> int:
        """How many sends may be in flight now."""
        return max(self.min_limit, min(self.max_limit, int(self.value)))

    def observe(self, began: float, latency_s: float, outcome: Outcome, in_flight: int) -> None:
        """One send that began at ``began`` (the clock's reading) ended after ``latency_s``
        with ``outcome``, ``in_flight`` sends (itself included) being in flight then."""
        if outcome == "ok":
            self._learn(latency_s)
            if self.smoothed_s <= TOLERANCE * self.floor_s + SLACK_S:
                if in_flight >= self.limit:
                    self._grow()
                return
        if began >= self.cut_at:  # one cut per round trip
            self._cut()

    def target(self, at: float) -> float:
        """Where the curve puts the limit at the clock's reading ``at`` (after a cut)."""
        return self.w_max + CUBIC * (at - self.cut_at - self.k_s) ** 3

    def _learn(self, latency_s: float) -> None:
        if latency_s < self.floor_s:
            self.floor_s = latency_s
        else:
            self.floor_s += (latency_s - self.floor_s) * FLOOR_DRIFT
        self.smoothed_s += (latency_s - self.smoothed_s) * (
            1.0 if self.smoothed_s == 0.0 else SMOOTHING
        )

    def _grow(self) -> None:
        if self.slow_start:
            step = 1.0
        else:  # towards the curve, at most one slot per round trip (a send in 1/value)
            step = min(self.target(self.clock()) - self.value, 1.0) / self.value
        if step > 0:
            self.value = min(float(self.max_limit), self.value + step)

    def _cut(self) -> None:
        self.slow_start = False
        self.w_max = self.value
        self.value = max(float(self.min_limit), self.value * DECREASE)
        self.k_s = ((self.w_max - self.value) / CUBIC) ** (1 / 3)
        self.smoothed_s = self.floor_s if math.isfinite(self.floor_s) else 0.0
        self.cut_at = self.clock()
        self.cuts += 1
