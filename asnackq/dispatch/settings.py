"""A run's fixed parameters, shared by its parts (committer, pacer, delivery coroutines)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asnackq.core import worker as w
from asnackq.core.endpoints import Schedule
from asnackq.core.rate import Rate
from asnackq.dispatch.events import Events

if TYPE_CHECKING:
    from asnackq.dispatch.spans import DeliverySpans

__all__ = ["RATE_CHECK_S", "RATE_GATHER_MS", "Settings", "SharedRate", "Trace"]

# Under a shared rate, results and claims gather this long at least (a waiting coroutine
# is not urgent: its ticket waits for a permit anyway): a paced run's sends trickle in,
# and a cycle per result would fill the queue's database with transactions.
RATE_GATHER_MS = 100
# A run given no rate of its own looks for the queue's this often: a rate set (or removed)
# by another worker binds it too.
RATE_CHECK_S = 1.0

# trace(kind, ticket, clock reading, status): kind "claim" (status None) or "finish"
# (status: the finish's result, False when stale).  Called outside any transaction.
Trace = Callable[[str, w.Ticket, int, "str | bool | None"], None]


@dataclass
class SharedRate:
    """The run's shared send rate (None: none): its own, or the queue's."""

    rate: Rate | None = None
    own: bool = False  # given to the run: never looked up in the queue


@dataclass(frozen=True, kw_only=True)
class Settings:
    """A run's fixed parameters, shared by its parts."""

    owner: str
    concurrency: int
    lease_ms: int
    clock: Callable[[], int]
    jitter: Callable[[], float]
    idle_ms: int
    gather_ms: int
    prefetch: int | None
    trace: Trace | None
    retry: w.Retry
    limits: w.Limits
    # the delays before a job's next attempt (None: ``retry``'s); ``retry`` alone paces the
    # re-sends while the sink is away and the waits an overload leaves unsaid
    schedule: w.Retry | Schedule | None = None
    shared: SharedRate = field(default_factory=SharedRate)  # every worker's, of the queue
    spans: DeliverySpans | None = None  # None: the run is not traced
    events: Events = field(default_factory=lambda: Events(""))  # what the run tells
    keep_attempts: bool = False  # each request's answer kept (``asnackq.store.attempts``)

    def retry_delay(
        self, ticket: w.Ticket, outcome: tuple[str, int], jitter: float
    ) -> tuple[str, int]:
        """``outcome`` (as ``w.judge_send`` gave it) with the schedule's delay if it is a retry."""
        if outcome[0] != "retry" or self.schedule is None:
            return outcome
        return "retry", self.schedule.delay(ticket["attempt"], jitter, self.limits)

    @property
    def rate(self) -> Rate | None:
        """The rate the run keeps to now (``shared``)."""
        return self.shared.rate

    @property
    def gather_s(self) -> float:
        """How long results may gather: ``gather_ms``, at most a tenth of the lease."""
        gather = self.gather_ms if self.rate is None else max(self.gather_ms, RATE_GATHER_MS)
        return min(gather, self.lease_ms // 10) / 1000
