"""Where a shared rate's send slots fall on this process's clock.

Rules of this module:

* A paced cycle (``asnackq.core.rate``) returns each ticket's slot as a wait after the
  database's clock reading.  The reading was taken inside the transaction, some time
  before the result reached this process: ``at - now`` (the event loop's clock when the
  result arrived, minus the reading) is the clocks' offset plus that delay, never less.
* The smallest such sample over the last ``SAMPLES`` cycles (and, at the start, a few
  direct readings of the database's clock: ``probe``) is the best estimate: a slot
  placed with it is never early (every sample is at least the true offset), and a cycle
  whose commit was slow does not push its sends late onto the next cycle's (which would
  bunch sends at the sink).  A window of samples, not all of them: a database clock
  stepped back leaves the window within ``SAMPLES`` cycles.
* The lead a claim asks for (``lead_us``) is the median time a cycle took, from its start
  to its result, over the last ``SAMPLES`` cycles (at most ``MAX_LEAD_US``): slots that
  begin that late are not overdue, in a bunch, when a commit hands them over.  The
  median, not the longest: a lead that grows skips the slots before it (nobody takes
  them), so it must move little from one cycle to the next.  Before the first cycle the
  lead is the longest, ``MAX_LEAD_US``: a worker's first slots are never overdue.
* No I/O but ``probe``'s reads; the event loop's clock is passed in.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable

from asnackq.core.rate import MAX_LEAD_US, SQL_RATE_CLOCK, Paced
from asnackq.dispatch.seam import Queue

__all__ = ["SAMPLES", "Slots"]

SAMPLES = 64
PROBES = 3


class Slots:
    """The offset between the database's clock and the event loop's, from paced cycles."""

    def __init__(self) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self.took: collections.deque[float] = collections.deque(maxlen=SAMPLES)

    def lead_us(self) -> int:
        """How long after the database's reading the next claim's first slot may be."""
        if not self.took:
            return MAX_LEAD_US
        return min(MAX_LEAD_US, round(statistics.median(self.took) * 1e6))

    async def probe(self, queue: Queue, clock: Callable[[], float]) -> None:
        """Read the database's clock ``PROBES`` times (a round trip each, no transaction):
        slots are placed right from the first cycle."""
        for _ in range(PROBES):
            [(now_us,)] = await queue.read(SQL_RATE_CLOCK)
            self.samples.append(clock() - now_us / 1e6)

    def place(self, paced: Paced, began: float, at: float) -> list[float]:
        """Each ticket's slot on the event loop's clock, for the cycle that began at
        ``began`` and whose result ``paced`` arrived at ``at``."""
        now_s = paced.now_us / 1e6
        self.took.append(at - began)
        self.samples.append(at - now_s)
        offset = min(self.samples)
        return [now_s + offset + wait / 1e6 for wait in paced.waits_us]
