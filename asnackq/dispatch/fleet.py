"""What a fleet decides for each endpoint: which Dispatcher it runs, and how often an idle
lane looks for new deliveries (``asnackq.aio.Fleet`` does the running).

Rules of this module (no I/O):

* ``plan(endpoint)`` is what an endpoint's Dispatcher is made with: its concurrency, rate
  and burst, retry schedule and order.  A change of it starts a new Dispatcher; anything
  else of the row (URL, secrets, timeout, success rule, headers) its send follows.
* ``idle_ms_for(n)``: with ``n`` lanes, each idle one looks every 20 ms, or less often, so
  that every idle lane together asks the database at most ``IDLE_CLAIMS_PER_S`` claims a
  second (and each looks at least every ``IDLE_MS_MAX``).
* An endpoint's lane takes retry delays up to the schedule's longest (``LANE_LIMITS``).
* ``add`` sums an endpoint's successive runs into one summary.
"""

from __future__ import annotations

from asnackq.core import endpoints as ep
from asnackq.core import worker as w
from asnackq.dispatch.summary import Summary

__all__ = ["AUTO_MAX", "IDLE_MS_MAX", "LANE_LIMITS", "REFRESH_S", "add", "idle_ms_for", "plan"]

REFRESH_S = 1.0
AUTO_MAX = 64  # concurrency "auto": the most sends in flight to one endpoint
IDLE_MS_MIN = 20
IDLE_MS_MAX = 500
IDLE_CLAIMS_PER_S = 400  # what every idle lane together may ask of the database a second
# an endpoint's lane takes retry delays as long as its schedule's (``endpoints.MAX_DELAY_MS``)
LANE_LIMITS = w.PRODUCT._replace(delay_ms=max(w.PRODUCT.delay_ms, ep.MAX_DELAY_MS))


def plan(endpoint: ep.Endpoint) -> tuple[object, ...]:
    """What an endpoint's Dispatcher is made with: a change of it starts a new one."""
    return (endpoint.concurrency, endpoint.rate, endpoint.burst, endpoint.retry, endpoint.ordered)


def idle_ms_for(lanes_count: int) -> int:
    """How often an idle lane polls when ``lanes_count`` lanes run: 20 ms, longer past
    eight lanes (at most ``IDLE_CLAIMS_PER_S`` idle claims a second, polls at most 0.5 s
    apart)."""
    wanted = 1000 * max(1, lanes_count) // IDLE_CLAIMS_PER_S
    return max(IDLE_MS_MIN, min(IDLE_MS_MAX, wanted))


def add(summaries: dict[str, Summary], name: str, summary: Summary) -> None:
    """Add ``summary``'s counts to ``name``'s."""
    before = summaries.get(name)
    if before is None:
        summaries[name] = summary
        return
    for key, value in summary.as_dict().items():
        if isinstance(value, int) and isinstance(getattr(before, key, None), int):
            setattr(before, key, getattr(before, key) + value)
