"""Where a shared rate's send slots fall on this process's clock.

Rules of this module:

* A paced cycle (``asnackq.core.rate``) returns each ticket's slot as a wait after the
  database's clock reading.  The reading was taken inside the transaction, some time
  before the result reached this process: ``at - now`` (the event loop's clock when the
  result arrived, minus the reading) is the clocks' offset plus that delay, never less.
* The smallest such sample over the last ``SAMPLES`` cycles is the best estimate: a slot
  placed with it is never early (every sample is at least the true offset), and a cycle
  whose commit was slow does not push its sends late onto the next cycle's (which would
  bunch sends at the sink).  A window of samples, not all of them: a database clock
  stepped back leaves the window within ``SAMPLES`` cycles.
* No I/O; the event loop's clock is passed in.
"""

from __future__ import annotations

import collections

from asnackq.core.rate import Paced

__all__ = ["SAMPLES", "Slots"]

SAMPLES = 64


class Slots:
    """The offset between the database's clock and the event loop's, from paced cycles."""

    def __init__(self) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=SAMPLES)

    def place(self, paced: Paced, at: float) -> list[float]:
        """Each ticket's slot on the event loop's clock; ``at``: when ``paced`` arrived."""
        now_s = paced.now_us / 1e6
        self.samples.append(at - now_s)
        offset = min(self.samples)
        return [now_s + offset + wait / 1e6 for wait in paced.waits_us]
