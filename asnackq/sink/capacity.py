"""A sink's capacity, for experiments: requests handled at once, and requests per second.

Rules of this module:

* ``max_inflight`` N: at most N events in service at once (admitted, not yet answered);
  one more is refused.  An event is answered ``delay_ms`` after its admission, its commit
  within that time if it can: N in flight with a delay of D is N / D events a second.
* ``max_rate`` R: a token bucket of R tokens a second holding at most ``burst(R)`` (a tenth
  of a second's worth, at least one); an event that finds no token is refused.  A request
  refused for its in-flight count takes no token.
* A refused event is answered ``429`` with ``Retry-After`` in whole seconds, before its
  body is read: nothing changes.  Past ``max_inflight``, the service time rounded down
  (a slot frees within it: ``0`` for a service under a second, which the header cannot
  say more finely); past ``max_rate``, when a token is sure to be there (at least one).
* Both are off (None) by default; the values are checked here, once, for the sink and the
  command line (``MAX_INFLIGHT``, ``SINK_RATES``).

No I/O: the clock (seconds, monotonic) is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from asnackq.core.worker import check_int
from asnackq.wire.send import check_number

__all__ = ["MAX_INFLIGHT", "SINK_RATES", "Capacity", "burst", "options_given"]

MAX_INFLIGHT = (1, 65_536)
SINK_RATES = (0, 1_000_000)  # (open low: a rate of 0 would refuse everything)


def options_given(*options: tuple[str, object]) -> tuple[object, ...]:
    """``asnackq sink`` options ``(name, value)`` as arguments, those whose value is set."""
    return tuple(item for name, value in options if value is not None for item in (name, value))


def burst(rate: float) -> float:
    """The most tokens the bucket holds: a tenth of a second's worth, at least one."""
    return max(1.0, rate / 10)


@dataclass
class Capacity:
    """Admit an event, or say how many seconds to wait; count what is in service."""

    max_inflight: int | None = None
    max_rate: float | None = None
    clock: Callable[[], float] = time.monotonic
    service_s: float = 0.0  # how long an admitted event is in service (the sink's delay)
    inflight: int = field(default=0, init=False)
    peak: int = field(default=0, init=False)  # the most events in flight at once
    _tokens: float = field(default=0.0, init=False)
    _filled_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.max_inflight is not None:
            check_int(self.max_inflight, "max_inflight", *MAX_INFLIGHT)
        if self.max_rate is not None:
            self.max_rate = check_number(self.max_rate, "max_rate", *SINK_RATES, open_low=True)
            self._tokens, self._filled_at = burst(self.max_rate), self.clock()

    def admit(self) -> int | None:
        """None: the event is admitted (``done()`` when it leaves its handler); else the
        whole seconds it should wait before it comes again."""
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            return int(self.service_s)
        if self.max_rate is not None and not self._take():
            return max(1, math.ceil((1 - self._tokens) / self.max_rate))
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        return None

    def done(self) -> None:
        """An admitted event left its handler."""
        self.inflight -= 1

    def _take(self) -> bool:
        assert self.max_rate is not None
        now = self.clock()
        elapsed = max(0.0, now - self._filled_at)
        self._tokens = min(burst(self.max_rate), self._tokens + elapsed * self.max_rate)
        self._filled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
