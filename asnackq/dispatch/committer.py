"""The Dispatcher's committer: finishes in; claims, extensions and tickets out.

Rules of this module:

* The committer is the one task that touches the queue: one ``cycle`` plan of the core per
  transaction (the finishes that came back, an extension of every held lease that ends
  within half a lease, claims for idle coroutines plus some ahead of demand, of jobs never
  attempted), so no transaction is open across a send and two never interleave.
* A held ticket (ready, being sent, or with its result waiting for the commit) never lapses
  while the run goes on: its lease is extended, fenced by its token, before half of it is
  left.  A ticket whose extension comes back stale is lost: it is not sent, or its result
  is dropped - never finished.  What a stopped run abandons stays leased and is reclaimed
  after the lease.
* While the database is away (``StoreUnavailable``: nothing committed) the cycle is tried
  again at the store's next reconnection, with its finishes; held tickets meet the fence
  there, never trusted.  A cycle of unknown outcome (``CommitUnknown``) lets go of the
  tickets it touched (``unconfirmed``).  A closing run waits ``CLOSE_WAIT_S`` at most.
* While every coroutine is busy, results gather for up to ``gather_ms`` before the cycle
  that settles them: fewer, larger transactions cost less CPU per job.  Gathering never
  keeps anyone waiting: a coroutine without a ticket, a lease to keep, a result whose lease
  ends within half a lease, or a draining run starts the cycle at once.  Its pause is timed
  by the event loop's clock, never by the run's (injectable) one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from asnackq.core import worker as w
from asnackq.dispatch.breaker import Breaker, BreakerPolicy
from asnackq.dispatch.runclock import RunClock
from asnackq.dispatch.summary import Summary
from asnackq.store.aio import AsyncQueue
from asnackq.store.outage import CommitUnknown, StoreUnavailable

__all__ = ["Claimed", "Committer", "Finish", "Phase", "Sent", "Settings", "Trace"]

# trace(kind, ticket, clock reading, status): kind "claim" (status None) or "finish"
# (status: the finish's result, False when stale).  Called outside any transaction.
Trace = Callable[[str, w.Ticket, int, "str | bool | None"], None]
CLOSE_WAIT_S = 10.0  # how long a closing run waits for its database to come back


class Claimed(NamedTuple):
    """A ticket as claimed, and the clock reading of its claim (the delivery's first)."""

    ticket: w.Ticket
    first: int


class Sent(NamedTuple):
    """What a coroutine hands back: the outcome of one send, or why there is none."""

    claimed: Claimed
    outcome: str | None  # ok / retry / permanent; None: nothing to finish
    now_ms: int = 0  # the second clock reading
    delay_ms: int = 0
    failure: str | None = None  # "bad_acks" or "errors" when outcome is None


class Finish(NamedTuple):
    """One finish as the core's plans take it, on the ticket's current lease."""

    ticket: w.Ticket
    outcome: str
    now_ms: int
    delay_ms: int


class Want(NamedTuple):
    """A cycle's claims: one per waiting coroutine (any job), and those kept ahead of demand
    (jobs never attempted: an unsent ticket lost with its worker costs a first attempt)."""

    waiting: int
    ahead: int


class Phase(enum.Enum):
    """Where a run stands; it only ever moves forward."""

    CLAIMING = 1  # claims for idle coroutines and ahead of demand
    DRAINING = 2  # no more claims: what is held is delivered, what comes back is settled
    CLOSING = 3  # every coroutine is done: settle the last results, then stop
    CLOSED = 4


@dataclass(frozen=True)
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

    @property
    def gather_s(self) -> float:
        """How long results may gather: ``gather_ms``, at most a tenth of the lease."""
        return min(self.gather_ms, self.lease_ms // 10) / 1000


class Committer:
    """Finishes in; claims, extensions and tickets out - one transaction per cycle."""

    def __init__(
        self, queue: AsyncQueue, settings: Settings, budget: int | None, breaker: BreakerPolicy
    ) -> None:
        self.queue, self.settings, self.budget = queue, settings, budget
        self.summary = Summary()
        self.now = RunClock(settings.clock, settings.limits)  # the run's readings
        self.breaker = Breaker(breaker, self.kick_now)
        self.phase = Phase.CLAIMING
        self.failure: BaseException | None = None
        self.held: dict[str, w.Ticket] = {}  # id -> the current lease of each held ticket
        self.capped: set[str] = set()  # held leases that end at their deadline
        self.ready: collections.deque[Claimed] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[Claimed | None]] = collections.deque()
        self.inbox: list[Sent] = []
        self.kick = asyncio.Event()
        self.taken = 0  # tickets taken since the last cycle began
        self.rate = 0.0  # tickets taken per second, over the last cycle
        self.period = self.txn_s = 0.0  # the last cycle: from start to start; its commit
        self.dry = False  # the last claim for waiting coroutines came up short
        self.dry_ahead = False  # the last claim ahead of demand did (no job never attempted)
        self.cycling = False  # a transaction is in flight
        self.gathering = False  # results are let gather (no kick per result)
        self.started = -math.inf  # the event loop's time at the last cycle
        self.clock = asyncio.get_running_loop().time
        self.closing_at = math.inf  # the event loop's time when the run began to close
        self.db_before = {} if queue.health is None else queue.health.counts()

    # --- the coroutines' side ----------------------------------------------------------

    async def take(self) -> Claimed | None:
        """The next ticket to send, or None when the run has none left for this coroutine."""
        while self.ready:
            claimed = self.ready.popleft()
            if self._holds(claimed.ticket):  # skip a ticket lost while it waited
                return self._taking(claimed)
        if self.phase is not Phase.CLAIMING and not self.cycling:
            return None  # (a cycle in flight may still hand out)
        waiter: asyncio.Future[Claimed | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self.kick.set()
        return await waiter

    def hand_back(self, sent: Sent) -> None:
        self.inbox.append(sent)
        if not self.gathering:
            self.kick.set()

    def kick_now(self) -> None:
        self.kick.set()

    def keeps(self, ticket: w.Ticket, now: int) -> bool:
        """Whether the run still holds this lease at ``now`` (a send may go under it)."""
        return self._holds(ticket) and now < self.held[ticket["id"]]["lease_until"]

    def lease_left_s(self, ticket: w.Ticket) -> float:
        """Seconds until the run's current lease on this ticket ends (0: not held)."""
        if not self._holds(ticket):
            return 0.0
        return max(0.0, (int(self.held[ticket["id"]]["lease_until"]) - self.now()) / 1000)

    def _taking(self, claimed: Claimed) -> Claimed:
        self.taken += 1
        return claimed

    def _holds(self, ticket: w.Ticket) -> bool:
        current = self.held.get(ticket["id"])
        return current is not None and current["token"] == ticket["token"]

    # --- the lifecycle's side ---------------------------------------------------------

    def drain(self) -> None:
        """Claim nothing more; coroutines finish what is held, then get None."""
        if self.phase is Phase.CLAIMING:
            self.phase = Phase.DRAINING
        if not self.cycling:
            self._release_waiters()
        self.kick.set()  # results gathering meanwhile are settled at once

    async def close(self, task: asyncio.Future[None]) -> None:
        """Every coroutine is done: let the committer settle the last results and end."""
        self.phase = Phase.CLOSING
        self.closing_at = self.clock()
        self.kick.set()
        await asyncio.wait([task])
        self.breaker.stop()
        counts = self.breaker.counts
        self.summary.outages, self.summary.probes = counts.outages, counts.probes
        self.summary.paused_ms = counts.paused_ms
        self.summary.clock_steps, self.summary.clock_step_ms = self.now.steps, self.now.largest_ms
        for name, value in self.db_counts().items():
            setattr(self.summary, name, value)

    def db_counts(self) -> dict[str, int]:
        """The queue's database outages during this run (``asnackq.store.outage``)."""
        health = self.queue.health
        if health is None:
            return {}
        return {name: n - self.db_before.get(name, 0) for name, n in health.counts().items()}

    # --- the loop -----------------------------------------------------------------------

    async def run(self, until_empty: bool, follow: bool) -> None:
        try:
            while self.phase is not Phase.CLOSED:
                try:
                    await self._step(until_empty, follow)
                except StoreUnavailable as error:
                    await self._outage(error)
        except Exception as error:  # the run's failure; held jobs stay leased
            self.failure = error
            self.ready.clear()
            self.drain()

    async def _step(self, until_empty: bool, follow: bool) -> None:
        self.kick.clear()
        now = self.now()
        want = self._want()
        due, wake_ms, pressing = self._due(now)
        if self.inbox or due or self._claims(want):
            pause = self._pause(bool(due or pressing), wake_ms)
            if pause > 0:
                await self._gather(pause)
                return
            await self._cycle(now, due, want)
        elif self.phase is Phase.CLOSING:
            self.phase = Phase.CLOSED
        elif (
            self.phase is Phase.CLAIMING and not self.held and await self._over(until_empty, follow)
        ):
            self.drain()
        else:
            await self._sleep(wake_ms)

    async def _outage(self, error: StoreUnavailable) -> None:
        """Wait for the store's next reconnection attempt (a closing run: up to a bound)."""
        if self.clock() - self.closing_at > CLOSE_WAIT_S:
            self.phase = Phase.CLOSED  # what it holds stays leased, reclaimed later
            return
        await asyncio.sleep(max(error.retry_in_s, 0.01))

    def _claims(self, want: Want) -> bool:
        """Whether to cycle for claims: wanted, and not found short since the idle poll."""
        return bool(want.waiting and not self.dry) or bool(want.ahead and not self.dry_ahead)

    async def _over(self, until_empty: bool, follow: bool) -> bool:
        """Whether the run has nothing more to claim (nothing is held right now)."""
        if self.budget == 0:
            return True
        if not self.dry or follow:
            return False
        return not until_empty or not (await self.queue.read(w.SQL_ACTIVE))[0][0]

    async def _sleep(self, wake_ms: int | None) -> None:
        """Wait for a kick, the next lease to keep, or (after a dry claim) the idle poll."""
        if (self.dry or self.dry_ahead) and self.phase is Phase.CLAIMING:
            wake_ms = min(wake_ms or self.settings.idle_ms, self.settings.idle_ms)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.kick.wait(), None if wake_ms is None else wake_ms / 1000)
        if not self.kick.is_set():
            self.dry = self.dry_ahead = False  # time to look for claimable jobs again

    def _pause(self, urgent: bool, wake_ms: int | None) -> float:
        """Seconds to let more results gather before the next cycle (0 or less: cycle now);
        never past ``wake_ms``, when the next held lease is due.  ``urgent``: a lease to keep
        or a result whose lease ends within half a lease."""
        if urgent or self.waiters or self.phase is not Phase.CLAIMING:
            return 0.0
        pause = self.started + self.settings.gather_s - self.clock()
        return pause if wake_ms is None else min(pause, wake_ms / 1000)

    async def _gather(self, pause: float) -> None:
        """Wait ``pause`` seconds, or until a coroutine needs a ticket."""
        self.gathering = True
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.kick.wait(), pause)
        finally:
            self.gathering = False

    def _due(self, now: int) -> tuple[list[w.Ticket], int | None, bool]:
        """Held leases ending within half a lease, the ms until the next one will, and whether
        a result waiting for its finish holds such a lease (its finish must not wait)."""
        if self.phase is Phase.CLOSING:
            return [], None, False  # what the coroutines left is abandoned
        half = self.settings.lease_ms // 2
        returning = {sent.claimed.ticket["id"] for sent in self.inbox}
        due, wake, pressing = [], None, False
        for job_id, ticket in self.held.items():
            left = ticket["lease_until"] - now - half
            if job_id in returning:
                pressing = pressing or left <= 0
            elif job_id in self.capped:
                continue
            elif left <= 0:
                due.append(ticket)
            elif wake is None or left < wake:
                wake = left
        return due, wake, pressing

    def _ahead(self) -> int:
        """How many ready tickets to keep ahead of demand.

        ``prefetch`` if given; otherwise twice what the coroutines take, at the rate of the
        last cycle, during that cycle or one gathering and one transaction if longer (so
        ready tickets outlast both, however long commits take on this disk), at least a
        quarter of the concurrency, at most eight per coroutine.
        """
        settings = self.settings
        if settings.prefetch is not None:
            return settings.prefetch
        need = math.ceil(2 * self.rate * max(self.period, settings.gather_s + self.txn_s))
        return max(settings.concurrency // 4, min(need, 8 * settings.concurrency, 1024))

    def _want(self) -> Want:
        """How many tickets to claim now: one per idle coroutine plus those kept ahead."""
        if self.phase is not Phase.CLAIMING:
            return Want(0, 0)
        if self.breaker.is_open:  # one ticket to probe with, if none is held
            return Want(int(not self.held and bool(self.waiters)), 0)  # (closing, it kicks us)
        budget = 1024 if self.budget is None else min(self.budget, 1024)
        waiting = min(len(self.waiters), budget)  # (a waiter means no ticket is ready)
        return Want(waiting, max(0, min(self._ahead() - len(self.ready), budget - waiting)))

    async def _cycle(self, now: int, due: list[w.Ticket], want: Want) -> None:
        """One transaction: settle what came back, keep what is held, claim ``want``."""
        sent, self.inbox = self.inbox, []
        finishes = self._finishes(sent)
        started = self.clock()
        if self.started > -math.inf:
            self.period = started - self.started
            self.rate = self.taken / max(self.period, 0.001)
        self.started, self.taken = started, 0
        self.cycling = True
        try:
            statuses, extended, tickets, ended = await self.queue.cycle(
                finishes, due, self.settings.owner, now, self.settings.lease_ms, *want
            )
        except CommitUnknown:  # committed or not: the tickets it touched are let go
            self._unconfirmed([finish.ticket for finish in finishes] + due)
            raise
        except StoreUnavailable:  # nothing committed: the finishes wait for the next cycle
            self.inbox[:0] = [item for item in sent if item.outcome is not None]
            raise
        finally:
            self.cycling = False
            self.txn_s = self.clock() - started
        self.summary.commits += 1
        self.summary.ended(ended)
        if want.waiting:
            self.dry = len(tickets) < want.waiting
        if want.ahead:
            self.dry_ahead = len(tickets) < sum(want)
        self._settled(finishes, statuses)
        self._kept(now, due, extended)
        self._claimed(now, tickets)
        if self.phase is not Phase.CLAIMING:
            self._release_waiters()  # nothing more will be claimed for them

    def _finishes(self, sent: list[Sent]) -> list[Finish]:
        """Finishes on the current leases; results of lost tickets or failed sends drop."""
        finishes = []
        for claimed, outcome, now_ms, delay_ms, failure in sent:
            if failure is not None:
                self.summary.fail(failure)
            if not self._holds(claimed.ticket):
                continue  # lost meanwhile: counted when it was
            if outcome is None:  # no answer to record: the job stays leased
                self._release(claimed.ticket["id"])  # (or dies by its deadline) and is
                continue  # reclaimed later
            finishes.append(Finish(self.held[claimed.ticket["id"]], outcome, now_ms, delay_ms))
        return finishes

    def _settled(self, finishes: list[Finish], statuses: list[str | bool]) -> None:
        for finish, status in zip(finishes, statuses, strict=True):
            self._release(finish.ticket["id"])
            if self.settings.trace is not None:
                self.settings.trace("finish", finish.ticket, finish.now_ms, status)
            self.summary.count(status)

    def _kept(self, now: int, due: list[w.Ticket], extended: list[w.Ticket | bool]) -> None:
        for old, new in zip(due, extended, strict=True):
            if new is False:
                self._release(old["id"])  # someone else may hold it now: never finish
                self.summary.lost += 1
                continue
            assert isinstance(new, dict)
            self.held[old["id"]] = new
            self.summary.extended += 1
            if new["lease_until"] < now + self.settings.lease_ms:
                self.capped.add(old["id"])  # at its deadline: no longer to extend

    def _claimed(self, now: int, tickets: list[w.Ticket]) -> None:
        if self.budget is not None:
            self.budget -= len(tickets)
        self.summary.claimed += len(tickets)
        for ticket in tickets:
            self.held[ticket["id"]] = ticket
            if self.settings.trace is not None:
                self.settings.trace("claim", ticket, now, None)
            self._hand_out(Claimed(ticket, now))

    def _unconfirmed(self, tickets: list[w.Ticket]) -> None:
        """Let go of the tickets a cycle of unknown outcome finished or extended (each job
        is done, or stays leased and is reclaimed after its lease, as are its claims)."""
        for ticket in tickets:
            self._release(ticket["id"])
        self.summary.unconfirmed += len(tickets)

    def _release(self, job_id: str) -> None:
        self.held.pop(job_id, None)
        self.capped.discard(job_id)

    def _hand_out(self, claimed: Claimed) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():  # a coroutine cancelled while waiting
                waiter.set_result(self._taking(claimed))
                return
        self.ready.append(claimed)

    def _release_waiters(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
