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
* ``seen`` is what a worker notes of an endpoint it serves (every ``NOTE_S``): its breaker
  open or not, its limit of sends in flight, and the tickets it holds now.
"""

from __future__ import annotations

from typing import Protocol

from asnackq.core import endpoints as ep
from asnackq.core import worker as w
from asnackq.dispatch.summary import Summary

__all__ = [
    "AUTO_MAX",
    "IDLE_MS_MAX",
    "LANE_LIMITS",
    "NOTE_S",
    "REFRESH_S",
    "add",
    "idle_ms_for",
    "plan",
    "seen",
]

REFRESH_S = 1.0
NOTE_S = 1.0  # how often a fleet notes what it sees of its endpoints
# what a run counts of the tickets it no longer holds
LET_GO = ("done", "retried", "dead", "stale", "lost", "unconfirmed", "errors", "bad_acks")
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


class Watched(Protocol):
    """What ``seen`` reads of a Dispatcher."""

    @property
    def paused(self) -> bool: ...

    def snapshot(self) -> dict[str, int]: ...


def seen(dispatcher: Watched) -> tuple[bool, int, int]:
    """``(breaker_open, limit, in_flight)`` of an endpoint's Dispatcher now: its limit is the
    adaptive one under "auto"; the tickets it holds are those claimed and not let go."""
    counts = dispatcher.snapshot()
    held = counts.get("claimed", 0) - sum(counts.get(key, 0) for key in LET_GO)
    return dispatcher.paused, counts.get("concurrency", 0), max(0, held)
