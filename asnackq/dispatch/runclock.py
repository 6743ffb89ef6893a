"""A run's clock: the wall clock, held where it stepped back until it catches up.

Rules of this module:

* A reading is never earlier than the run's last one.  The core refuses a delivery's
  second reading earlier than its first (``run_once``'s contract), and the Dispatcher reads
  once at the claim and once after the send: a wall clock stepped back (an NTP step) between
  the two must not end the run.
* When the wall clock reads earlier than the last reading, the run's clock holds that last
  reading until the wall clock passes it: time stands still for as long as the step, then
  follows the wall clock again.  A step forward is followed at once.
* Held readings are never behind this host's wall clock, so a lease this worker holds is
  never kept later, in wall time, than the wall clock says (fencing and the extension rule
  are unchanged).  While held, leases, deadlines and retry delays measured by this worker
  advance by nothing: its jobs may wait up to the step longer, nothing more.
* Only the given clock is read: a clock injected for tests stays exact.
"""

from __future__ import annotations

from collections.abc import Callable

from asnackq.core import worker as w

__all__ = ["RunClock"]


class RunClock:
    """The readings of ``clock``, never earlier than the last one (see the module's rules)."""

    def __init__(self, clock: Callable[[], object], limits: w.Limits) -> None:
        self.clock, self.limits = clock, limits
        self.top = limits.max_now  # (the latest valid reading: ``w.check_now``'s bound)
        self.last = 0
        self.steps = 0  # times the clock was found stepped back (each step counted once)
        self.largest_ms = 0  # the largest step back seen
        self._held = False

    def __call__(self, name: str = "clock reading") -> int:
        """A checked reading of the clock, held at the last one while the clock is behind."""
        reading = self.clock()
        if type(reading) is not int or not 0 <= reading <= self.top:
            reading = w.check_now(reading, name, self.limits)  # (it raises)
        if reading >= self.last:
            self.last, self._held = reading, False
            return reading
        if not self._held:
            self.steps, self._held = self.steps + 1, True
        self.largest_ms = max(self.largest_ms, self.last - reading)
        return self.last

    read = __call__  # (a bound method: called without the lookup of an instance's call)
