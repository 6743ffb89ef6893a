"""The Dispatcher's committer: finishes in; claims, extensions and tickets out.

Rules of this module:

* The committer is the one task that touches the queue: one ``cycle`` plan of the core per
  transaction (the finishes that came back, an extension of every held lease that ends
  within half a lease, claims for idle coroutines plus some ahead of demand, of jobs never
  attempted), so no transaction is open across a send and two never interleave.
* The tickets a run holds are its own, as the queue's plans issued them: no code outside
  the run gets one (a trace gets copies, at the claim and at the finish), none is changed,
  so the cycle's plan takes them unchecked (``worker.plan_cycle``'s ``own``; each is still
  fenced by its job's row).
* A held ticket (ready, being sent, or with its result waiting for the commit) never lapses
  while the run goes on: its lease is extended, fenced by its token, before half of it is
  left.  A ticket whose extension comes back stale is lost: it is not sent, or its result
  is dropped - never finished.  What a stopped run abandons stays leased and is reclaimed
  after the lease.
* While the database is away (``StoreUnavailable``: nothing committed) the cycle is tried
  again at the store's next reconnection, with its finishes; held tickets meet the fence
  there, never trusted.  A cycle of unknown outcome (``CommitUnknown``) lets go of the
  tickets it touched (``unconfirmed``).  A closing run waits ``CLOSE_WAIT_S`` at most for
  its database, also for the outcome of a COMMIT whose answer was lost.
* While every coroutine is busy, results gather for up to ``gather_ms`` before the cycle
  that settles them: fewer, larger transactions cost less CPU per job.  Gathering never
  keeps anyone waiting: a coroutine without a ticket, a lease to keep, a result whose lease
  ends within half a lease, or a draining run starts the cycle at once.  Its pause is timed
  by the event loop's clock, never by the run's (injectable) one.
* Its parts: the held leases are a ``Ledger``, the claims ahead and the gathering a
  ``Pacer``; the committer keeps the loop, the phase and the hand-out of tickets, and gives
  each delivery coroutine a ``Port``.
* Only the committer changes the run's state: the coroutines' counts of requests and the
  breaker's samples come in as values (``report``'s), their results as ``Sent``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import math
from typing import NamedTuple

from asnackq.core import worker as w
from asnackq.dispatch.breaker import Breaker, BreakerPolicy
from asnackq.dispatch.gate import Gate
from asnackq.dispatch.ledger import Due, Ledger
from asnackq.dispatch.pacer import Pacer, Want
from asnackq.dispatch.port import Port
from asnackq.dispatch.runclock import RunClock
from asnackq.dispatch.seam import Queue
from asnackq.dispatch.settings import RATE_CHECK_S, Settings
from asnackq.dispatch.slots import Slots
from asnackq.dispatch.summary import Summary
from asnackq.dispatch.tickets import Claimed, Sent, made
from asnackq.store.attempts import Record
from asnackq.store.outage import CommitUnknown, StoreUnavailable
from asnackq.store.targets import one_line

__all__ = ["CLOSE_WAIT_S", "Committer", "Finish", "Phase"]

CLOSE_WAIT_S = 10.0  # how long a closing run waits for its database to come back


class Finish(NamedTuple):
    """One finish as the core's plans take it, on the ticket's current lease."""

    ticket: w.Ticket
    outcome: str
    now_ms: int
    delay_ms: int


class Phase(enum.Enum):
    """Where a run stands; it only ever moves forward."""

    CLAIMING = 1  # claims for idle coroutines and ahead of demand
    DRAINING = 2  # no more claims: what is held is delivered, what comes back is settled
    CLOSING = 3  # every coroutine is done: settle the last results, then stop
    CLOSED = 4


class Committer:
    """Finishes in; claims, extensions and tickets out - one transaction per cycle."""

    def __init__(
        self,
        queue: Queue,
        settings: Settings,
        budget: int | None,
        breaker: BreakerPolicy,
        gate: Gate | None = None,
    ) -> None:
        """``gate``: concurrency "auto"'s (None: ``settings.concurrency`` sends at once)."""
        self.queue, self.settings, self.budget = queue, settings, budget
        self.summary = Summary()
        self.run_clock = RunClock(settings.clock, settings.limits)  # the run's readings
        self.events = settings.events
        self.breaker = Breaker(breaker, self.kick_now, self.events)
        self.ledger = Ledger(settings.lease_ms)
        self.loop_time = asyncio.get_running_loop().time
        self.gate = gate
        self.pacer = Pacer(settings, self.loop_time, gate)
        self.phase = Phase.CLAIMING
        self.failure: BaseException | None = None
        self.ready: collections.deque[Claimed] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[Claimed | None]] = collections.deque()
        self.returned: list[Sent] = []  # results handed back, not yet finished
        self.records: list[Record] = []  # requests' answers to keep, not yet written
        self.kick = asyncio.Event()
        self.cycling = False  # a transaction is in flight
        self.gathering = False  # results are let gather (no kick per result)
        self.closing_at = math.inf  # the event loop's time when the run began to close
        self.rate_short = False  # the shared rate's permits cut the last claim short
        self.permits_at = 0.0  # (the event loop's clock) no permit is granted before then
        self.slots = Slots()  # where the shared rate's slots fall on the event loop's clock
        self.slot_waiters: collections.deque[asyncio.Future[float | None]] = collections.deque()
        self.rate_check_at = self.loop_time() + RATE_CHECK_S  # (a run's start looked already)
        self.db_before = {} if queue.health is None else queue.health.counts()
        self.db_away_since: float | None = None  # (the event loop's clock) the database away
        self.told = (0, 0)  # the clock steps and limit cuts told so far

    # --- the coroutines' side ----------------------------------------------------------

    def port(self) -> Port:
        """What a delivery coroutine may use of this run."""
        return Port(
            take=self.take,
            again=self.again,
            hand_back=self.hand_back,
            report=self.report,
            leases=self.ledger,
            now=self.run_clock.read,
            breaker=self.breaker,
            settings=self.settings,
            gate=self.gate,
        )

    async def take(self) -> Claimed | None:
        """The next ticket to send, or None when the run has none left for this coroutine."""
        while self.ready:
            claimed = self.ready.popleft()
            if self.ledger.holds(claimed.ticket):  # skip a ticket lost while it waited
                self.pacer.took()
                return claimed
        if self.phase is not Phase.CLAIMING and not self.cycling:
            return None  # (a cycle in flight may still hand out)
        waiter: asyncio.Future[Claimed | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        self.kick.set()
        return await waiter

    async def again(self) -> float | None:
        """A new send slot (the event loop's clock) for a held ticket whose slot passed
        unsent; None when the run has closed."""
        if self.phase is Phase.CLOSED or self.failure is not None:
            return None
        waiter: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self.slot_waiters.append(waiter)
        self.kick.set()
        return await waiter

    def hand_back(self, sent: Sent) -> None:
        """A ticket's result, settled by the next cycle; a fatal one drains the run."""
        self.returned.append(sent)
        if sent.fatal:
            self.drain()
        elif not self.gathering:
            self.kick.set()

    def report(
        self,
        probe: bool | None,
        unavailable: bool | None,
        sent: bool = False,
        resent: bool = False,
        overloaded: bool = False,
        cause: str = "away",
        why: str = "",
        record: Record | None = None,
    ) -> None:
        """What one pass of a coroutine's send loop saw (``tickets.Report``): the run's
        counts of requests and the breaker's sample change here, and nowhere else."""
        if sent:
            summary = self.summary
            summary.requests += 1
            summary.resent += resent
            summary.overloaded += overloaded
            if unavailable:
                summary.unanswered(cause)
        self.breaker.record(probe, unavailable, cause, why)
        if record is not None:
            self.records.append(record)

    def kick_now(self) -> None:
        self.kick.set()

    # --- the lifecycle's side ---------------------------------------------------------

    def wake(self) -> None:
        """New jobs may be claimable: the next cycle looks, not only the idle poll."""
        self.pacer.poll_again()
        self.kick.set()

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
        self.closing_at = self.loop_time()
        self.queue.give_up_after(CLOSE_WAIT_S)  # (a cut COMMIT's lookup too)
        self.kick.set()
        await asyncio.wait([task])
        self.breaker.stop()
        if self.settings.spans is not None:
            self.settings.spans.close()
        counts = self.breaker.counts
        self.summary.outages, self.summary.probes = counts.outages, counts.probes
        self.summary.paused_ms = counts.paused_ms
        self.summary.clock_steps, self.summary.clock_step_ms = (
            self.run_clock.steps,
            self.run_clock.largest_ms,
        )
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
                    if self.db_away_since is None:
                        self.db_away_since = self.loop_time()
                        self.events.emit(
                            "db_down",
                            "the queue's database is away: waiting for it, sends go on",
                            logging.WARNING,
                            error=one_line(error),
                        )
                    await self._outage(error)
        except Exception as error:  # the run's failure; held jobs stay leased
            self.failure = error
            self.ready.clear()
            self.drain()
        finally:  # no more slots: a coroutine waiting for one does not send
            while self.slot_waiters:
                if not (waiter := self.slot_waiters.popleft()).done():
                    waiter.set_result(None)

    async def _step(self, until_empty: bool, follow: bool) -> None:
        looking = self.phase is Phase.CLAIMING and not self.settings.shared.own
        if looking and self.loop_time() >= self.rate_check_at:
            await self._look_for_rate()
        self.kick.clear()
        now = self.run_clock()
        self._prune_slot_waiters()
        permits_ms = math.ceil(max(0.0, self.permits_at - self.loop_time()) * 1000)
        want = Want(0, 0) if permits_ms else self._want()  # (no permit before permits_at)
        asking = bool(self.slot_waiters) and not permits_ms
        due, wake_ms, pressing = self._due(now)
        if permits_ms:
            wake_ms = permits_ms if wake_ms is None else min(wake_ms, permits_ms)
        if self.returned or due or self.pacer.claims(want) or asking:
            waiting = bool(self.waiters) and self.settings.rate is None  # (paced: see Settings)
            urgent = bool(due or pressing or waiting) or self.phase is not Phase.CLAIMING
            pause = self.pacer.pause(urgent, wake_ms)
            if pause > 0:
                await self._gather(pause)
                return
            await self._cycle(now, due, want, asking)
        elif self.phase is Phase.CLOSING:
            self.phase = Phase.CLOSED
        elif (
            self.phase is Phase.CLAIMING
            and not self.ledger
            and await self._over(until_empty, follow)
        ):
            self.drain()
        else:
            await self._sleep(wake_ms)

    async def _look_for_rate(self) -> None:
        """A run given no rate keeps to the queue's: set, changed or removed meanwhile."""
        self.rate_check_at = self.loop_time() + RATE_CHECK_S
        shared, found = self.settings.shared, await self.queue.shared_rate()
        if found == shared.rate:
            return
        if found is not None and shared.rate is None:
            await self.slots.probe(self.queue, self.loop_time)
        shared.rate = found
        if found is None:
            self.events.emit("rate", "the shared rate was removed", per_s=None, burst=None)
        else:
            self.events.emit(
                "rate", "the shared rate changed", per_s=found.per_s, burst=found.burst
            )
        if found is None:  # unpaced now: a coroutine waiting for a new slot has it now
            while self.slot_waiters:
                if not (waiter := self.slot_waiters.popleft()).done():
                    waiter.set_result(self.loop_time())

    def _prune_slot_waiters(self) -> None:
        """Forget the waiters for a new slot that were cancelled; a closing run grants none
        (every coroutine is done: a waiter left is one that was cancelled)."""
        for waiter in [waiter for waiter in self.slot_waiters if waiter.done()]:
            self.slot_waiters.remove(waiter)
        while self.phase is Phase.CLOSING and self.slot_waiters:
            self.slot_waiters.popleft().set_result(None)

    def _due(self, now: int) -> Due:
        """The held leases to extend now (see ``Ledger.due``)."""
        if self.phase is Phase.CLOSING:
            return Due([], None, False)  # what the coroutines left is abandoned
        return self.ledger.due(now, {sent.claimed.ticket["id"] for sent in self.returned})

    async def _outage(self, error: StoreUnavailable) -> None:
        """Wait for the store's next reconnection attempt (a closing run: up to a bound)."""
        if self.loop_time() - self.closing_at > CLOSE_WAIT_S:
            self.phase = Phase.CLOSED  # what it holds stays leased, reclaimed later
            return
        await asyncio.sleep(max(error.retry_in_s, 0.01))

    async def _over(self, until_empty: bool, follow: bool) -> bool:
        """Whether the run has nothing more to claim (nothing is held right now)."""
        if self.budget == 0:
            return True
        if not self.pacer.dry or follow or self.rate_short:
            return False
        return not until_empty or not (await self.queue.read(w.SQL_ACTIVE))[0][0]

    async def _sleep(self, wake_ms: int | None) -> None:
        """Wait for a kick, the next lease to keep, or (after a dry claim) the idle poll."""
        if self.phase is Phase.CLAIMING:
            wake_ms = self.pacer.idle_wake(wake_ms)
        with contextlib.suppress(TimeoutError):  # (never ``wait_for``: see ``breaker.admit``)
            async with asyncio.timeout(None if wake_ms is None else wake_ms / 1000):
                await self.kick.wait()
        if not self.kick.is_set():
            self.pacer.poll_again()

    async def _gather(self, pause: float) -> None:
        """Wait ``pause`` seconds, or until a coroutine needs a ticket."""
        self.gathering = True
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self.kick.wait()
        finally:
            self.gathering = False

    def _want(self) -> Want:
        """How many tickets to claim now: one per idle coroutine plus those kept ahead."""
        if self.phase is not Phase.CLAIMING:
            return Want(0, 0)
        if self.breaker.is_open:  # one ticket to probe with, if none is held
            return Want(int(not self.ledger and bool(self.waiters)), 0)  # (closing, it kicks us)
        return self.pacer.want(len(self.waiters), len(self.ready), self.budget)

    async def _cycle(self, now: int, due: list[w.Ticket], want: Want, asking: bool) -> None:
        """One transaction: settle what came back, keep what is held, claim ``want``."""
        sent, self.returned = self.returned, []
        records, self.records = self.records, []
        finishes = self._finishes(sent)
        started = self.pacer.begin()
        self.cycling = True
        try:
            (statuses, extended, tickets, ended), slots = await self._transact(
                finishes, due, now, want, asking, records
            )
            if self.settings.spans is not None:  # (before any ticket is handed out)
                finished = [finish.ticket for finish in finishes]
                await self.settings.spans.cycled(self.queue, finished, statuses, tickets)
        except CommitUnknown:  # committed or not: the tickets it touched are let go
            self._unconfirmed([finish.ticket for finish in finishes] + due)
            raise
        except StoreUnavailable:  # nothing committed: the finishes wait for the next cycle
            self.returned[:0] = [item for item in sent if item.outcome is not None]
            self.records[:0] = records
            raise
        finally:
            self.cycling = False
            self.pacer.end(started)
        self.summary.commits += 1
        self.summary.ended(ended)
        self._tell(ended)
        self.pacer.found(want, len(tickets))
        self._settled(finishes, statuses)
        lost = self.ledger.kept(now, due, extended)
        self.summary.lost += lost
        self.summary.extended += len(due) - lost
        self._claimed(now, tickets, slots, want.waiting)
        if self.phase is not Phase.CLAIMING:
            self._release_waiters()  # nothing more will be claimed for them

    def _tell(self, ended: dict[str, int]) -> None:
        """The events of a committed cycle: the database back, jobs ended dead, the clock
        stepped back, the adaptive limit cut."""
        events = self.events
        if self.db_away_since is not None:
            down_ms = round((self.loop_time() - self.db_away_since) * 1000)
            self.db_away_since = None
            events.emit("db_back", "the queue's database is back", down_ms=down_ms)
        if dead := sum(ended.values()):
            reasons = {reason: n for reason, n in ended.items() if n}
            events.emit("dead", "jobs ended dead", logging.WARNING, jobs=dead, reasons=reasons)
        steps, cuts = self.run_clock.steps, 0 if self.gate is None else self.gate.cuts
        if steps > self.told[0]:
            events.emit(
                "clock_step",
                "the clock stepped back: readings held at the last one",
                logging.WARNING,
                step_ms=self.run_clock.largest_ms,
                steps=steps,
            )
        if cuts > self.told[1] and self.gate is not None:
            events.emit("limit", "concurrency cut", concurrency=self.gate.limit, cuts=cuts)
        self.told = (steps, cuts)

    async def _transact(
        self,
        finishes: list[Finish],
        due: list[w.Ticket],
        now: int,
        want: Want,
        asking: bool,
        records: list[Record],
    ) -> tuple[w.Cycle, list[float]]:
        """The cycle's transaction; under a shared rate its claims (and, ``asking``, the
        held tickets waiting for a new slot) take permits, and each ticket gets its send
        slot on the event loop's clock (``asnackq.core.rate``).  Permits cut short are
        not asked for again before the rate can grant one (``permits_at``)."""
        claim = (self.settings.owner, now, self.settings.lease_ms, want.waiting, want.ahead)
        rate = self.settings.rate
        if rate is None:
            cycle = await self.queue.cycle(finishes, due, *claim, attempts=records, own=True)
            return cycle, []
        began, lead = self.loop_time(), self.slots.lead_us()
        waiting = [waiter for waiter in self.slot_waiters if not waiter.done()] if asking else []
        paced = await self.queue.paced_cycle(
            rate,
            finishes,
            due,
            *claim,
            again=len(waiting),
            lead_us=lead,
            attempts=records,
            own=True,
        )
        self.rate_short = paced.short
        self.permits_at = self.loop_time() + paced.retry_us / 1e6 if paced.short else 0.0
        placed = self.slots.place(paced, began, self.loop_time())
        for waiter, slot in zip(waiting, placed[: paced.again], strict=False):
            self.slot_waiters.remove(waiter)
            if not waiter.done():  # (cancelled meanwhile: its slot passes unused)
                waiter.set_result(slot)
        return paced.cycle, placed[paced.again :]

    def _finishes(self, sent: list[Sent]) -> list[Finish]:
        """Finishes on the current leases; results of lost tickets or failed sends drop."""
        finishes = []
        for claimed, outcome, now_ms, delay_ms, failure, _ in sent:
            if failure is not None:
                self.summary.fail(failure)
            if (current := self.ledger.held(claimed.ticket)) is None:
                if self.settings.spans is not None:
                    self.settings.spans.end(claimed.ticket, "lost")
                continue  # lost meanwhile: counted when it was
            if outcome is None:  # no answer to record: the job stays leased
                self.ledger.release(claimed.ticket["id"])  # (or dies by its deadline) and
                continue  # is reclaimed later
            finishes.append(made(Finish, (current, outcome, now_ms, delay_ms)))
        return finishes

    def _settled(self, finishes: list[Finish], statuses: list[str | bool]) -> None:
        if len(statuses) != len(finishes):  # (a queue's cycle answers each finish)
            raise ValueError(f"{len(statuses)} statuses for {len(finishes)} finishes")
        self.ledger.settled([finish.ticket for finish in finishes])
        if (trace := self.settings.trace) is not None:
            for finish, status in zip(finishes, statuses, strict=True):
                trace("finish", finish.ticket.copy(), finish.now_ms, status)
        self.summary.count(statuses)

    def _claimed(
        self, now: int, tickets: list[w.Ticket], slots: list[float], first: int = 0
    ) -> None:
        """Hold and hand out a cycle's tickets; the ``first`` (claimed as any job, see
        ``pacer``) that no coroutine waits for go before every ready ticket, unless paced
        (``slots``: each ticket's send time)."""
        if self.budget is not None:
            self.budget -= len(tickets)
        self.summary.claimed += len(tickets)
        ahead: list[Claimed] = []
        paced = slots or [0.0] * len(tickets)
        self.ledger.hold(tickets)
        for n, (ticket, slot) in enumerate(zip(tickets, paced, strict=True)):
            if self.settings.trace is not None:  # (a copy: the held ticket is the run's own)
                self.settings.trace("claim", ticket.copy(), now, None)
            claimed = made(Claimed, (ticket, now, slot))
            if self.waiters:
                self._hand_out(claimed)
            elif n < first and not slots:
                ahead.append(claimed)
            else:
                self.ready.append(claimed)  # (``_hand_out`` with no coroutine waiting)
        self.ready.extendleft(reversed(ahead))  # (sent next)

    def _unconfirmed(self, tickets: list[w.Ticket]) -> None:
        """Let go of the tickets a cycle of unknown outcome finished or extended (each job
        is done, or stays leased and is reclaimed after its lease, as are its claims)."""
        for ticket in tickets:
            self.ledger.release(ticket["id"])
        self.summary.unconfirmed += len(tickets)

    def _hand_out(self, claimed: Claimed) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():  # a coroutine cancelled while waiting
                self.pacer.took()
                waiter.set_result(claimed)
                return
        self.ready.append(claimed)

    def _release_waiters(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
