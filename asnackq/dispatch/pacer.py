"""How many tickets a run claims ahead of demand, and how long results gather.

Rules of this module:

* A cycle claims one ticket per waiting coroutine, plus some ahead of demand (jobs never
  attempted: an unsent ticket lost with its worker costs a first attempt).  Ahead of demand
  is ``prefetch`` if given, else what the coroutines take in the time ready tickets must
  outlast (see ``ahead``).
* While no coroutine waits and the last claim ahead found all it asked (jobs never attempted
  keep every coroutine busy), at least every ``ANY_S`` one of the tickets ahead is claimed
  as for a waiting coroutine: any claimable job, the lowest seq first.  Only that claim
  takes a retry that fell due or a lease another worker let lapse; such a job otherwise
  waited behind every job never attempted, past its deadline.  Such a ticket goes before
  every ready one (``committer``): at most one a second waits unsent, for the next
  coroutine free, with an attempt spent on it.  Once the jobs never attempted run short,
  coroutines come free and wait, and claims ahead take only those jobs again.
* A claim that came up short is not tried again before the idle poll (``dry``), unless
  something else starts a cycle.
* Results gather for up to ``gather_s`` from the last cycle's start, never past the next
  lease due, and not at all when something is urgent.
* No I/O and no event loop: ``clock`` is the event loop's clock (never the run's
  injectable one), passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from asnackq.dispatch.gate import Gate
from asnackq.dispatch.settings import Settings

__all__ = ["ANY_S", "Pacer", "Want"]

CLAIM_MAX = 1024  # the most tickets one cycle claims
AHEAD_FLOOR = 64  # the bound on tickets ahead of demand is never below this (per_send)
ANY_S = 1.0  # while no coroutine waits, a claim of any job at least this often (seconds)


class Want(NamedTuple):
    """A cycle's claims: one per waiting coroutine (any job), and those kept ahead of demand
    (jobs never attempted); ``anyjob``: the claim for waiting coroutines is one of the
    tickets ahead (no coroutine waits), so the dryness of the claims ahead governs it."""

    waiting: int
    ahead: int
    anyjob: bool = False


class Pacer:
    """The pace of a run's cycles: the take rate, the last cycle's timings, dry claims."""

    def __init__(
        self, settings: Settings, clock: Callable[[], float], gate: Gate | None = None
    ) -> None:
        self.settings, self.clock = settings, clock
        self.taken = 0  # tickets taken since the last cycle began
        self.rate = 0.0  # tickets taken per second, over the last cycle
        self.period = self.txn_s = 0.0  # the last cycle: from start to start; its commit
        self.started = -math.inf  # the clock at the last cycle's start
        self.dry = False  # the last claim for waiting coroutines came up short
        self.dry_ahead = False  # the last claim ahead of demand did (no job never attempted)
        self.any_at = clock()  # the clock at the last claim of any job (for waiting coroutines)
        self.backlog = False  # the last claim ahead found all it asked (not reset by a poll)
        # the sends let in flight: the concurrency, or (concurrency "auto") the gate's limit
        self.concurrency: Callable[[], int] = (
            (lambda: settings.concurrency) if gate is None else (lambda: gate.limit)
        )
        # the most ready tickets per send let in flight (a gate lets its holders wait instead)
        self.per_send = 8 if gate is None else 0

    def took(self) -> None:
        """A coroutine took a ticket."""
        self.taken += 1

    def ahead(self) -> int:
        """How many ready tickets to keep ahead of demand.

        ``prefetch`` if given; otherwise twice what the coroutines take, at the rate of the
        last cycle, during that cycle or one gathering and one transaction if longer (so
        ready tickets outlast both, however long commits take on this disk), at least a
        quarter of the concurrency, at most ``per_send`` per send let in flight or
        ``AHEAD_FLOOR`` if that is more (with few sends in flight, eight per send run out
        within one gathering: each coroutine would wait for a whole transaction every
        eighth ticket); with a gate, no more than that quarter.
        """
        settings = self.settings
        if settings.prefetch is not None:
            return settings.prefetch
        need = math.ceil(2 * self.rate * max(self.period, settings.gather_s + self.txn_s))
        concurrency = self.concurrency()
        most = max(self.per_send * concurrency, AHEAD_FLOOR) if self.per_send else 0
        return max(concurrency // 4, min(need, most, CLAIM_MAX))

    def want(self, waiting: int, ready: int, budget: int | None) -> Want:
        """The claims for ``waiting`` coroutines, with ``ready`` tickets unclaimed by any and
        ``budget`` claims left to the run (None: no bound)."""
        budget = CLAIM_MAX if budget is None else min(budget, CLAIM_MAX)
        waiting = min(waiting, budget)  # (a waiter means no ticket is ready)
        ahead = max(0, min(self.ahead() - ready, budget - waiting))
        if not waiting and ahead and self.backlog and self.clock() - self.any_at >= ANY_S:
            return Want(1, ahead - 1, True)  # (one of them of any job: see the rules)
        return Want(waiting, ahead)

    def claims(self, want: Want) -> bool:
        """Whether to cycle for claims: wanted, and not found short since the idle poll."""
        if want.anyjob:
            return not self.dry_ahead
        return bool(want.waiting and not self.dry) or bool(want.ahead and not self.dry_ahead)

    def found(self, want: Want, claimed: int) -> None:
        """A cycle claimed ``claimed`` tickets for ``want``.  A claim of any job among the
        tickets ahead counts as one of them, short by one at most (its job poisoned, or no
        job but those never attempted) before the claims ahead are dry."""
        if want.waiting and not want.anyjob:
            self.dry = claimed < want.waiting
        if want.waiting:
            self.any_at = self.clock()
        if want.ahead or want.anyjob:
            self.dry_ahead = claimed < want.ahead + want.waiting - want.anyjob
            self.backlog = not self.dry_ahead

    def idle_wake(self, wake_ms: int | None) -> int | None:
        """When an idle run wakes: ``wake_ms`` (the next lease due), or sooner for the idle
        poll after a dry claim."""
        if self.dry or self.dry_ahead:
            idle_ms = self.settings.idle_ms
            return min(wake_ms or idle_ms, idle_ms)
        return wake_ms

    def poll_again(self) -> None:
        """The idle poll: look for claimable jobs again."""
        self.dry = self.dry_ahead = False

    def pause(self, urgent: bool, wake_ms: int | None) -> float:
        """Seconds to let more results gather before the next cycle (0 or less: cycle now);
        never past ``wake_ms``, when the next held lease is due."""
        if urgent:
            return 0.0
        pause = self.started + self.settings.gather_s - self.clock()
        return pause if wake_ms is None else min(pause, wake_ms / 1000)

    def begin(self) -> float:
        """A cycle starts: the take rate over the last one; returns the clock at its start."""
        started = self.clock()
        if self.started > -math.inf:
            self.period = started - self.started
            self.rate = self.taken / max(self.period, 0.001)
        self.started, self.taken = started, 0
        return started

    def end(self, started: float) -> None:
        """The cycle that started at ``started`` ended its transaction."""
        self.txn_s = self.clock() - started
