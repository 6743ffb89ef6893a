"""The Dispatcher: many delivery coroutines over one ``AsyncQueue``, in three parts.

* ``Committer`` owns every transaction and every ticket the run holds.  Each cycle is one
  ``cycle`` plan of the core: the finishes that came back, an extension of every held lease
  that ends within half a lease, and claims for idle coroutines plus some ahead of demand.
  While every coroutine is busy, results gather for up to ``gather_ms`` before the cycle
  that settles them: fewer, larger transactions cost less CPU per job.
* ``deliver`` is one delivery coroutine: take a ticket, send it (again, while the sink is
  not there: see ``breaker``), hand the result back.
* ``Dispatcher.run`` is the lifecycle: start, drain, close, cancel (``Phase``).

Rules of this module:

* Coroutines never touch the queue: no transaction is open across a send, and one task
  (the committer) runs them all, so two transactions never interleave.
* A held ticket (ready, being sent, or with its result waiting for the commit) never lapses
  while the run goes on: its lease is extended, fenced by its token, before half of it is
  left.  A ticket whose extension comes back stale is lost: it is not sent, or its result
  is dropped - never finished.  What a stopped run abandons stays leased and is reclaimed
  after the lease.
* The clock's reading at a claim is the delivery's first reading; the coroutine takes the
  second when the send returns, exactly as ``run_once`` does.
* Gathering never keeps anyone waiting: a coroutine without a ticket, a lease to keep, a
  result whose lease ends within half a lease, or a draining run starts the cycle at once.
  Its pause is timed by the event loop's clock, never by the run's (injectable) one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from asnackq.aio import AsyncQueue, AsyncSend
from asnackq.breaker import Breaker, BreakerPolicy
from asnackq.core import worker as w

DEFAULT_BREAKER = BreakerPolicy()

__all__ = ["Claimed", "Dispatcher", "Finish", "Phase", "Sent", "Summary"]

# trace(kind, ticket, clock reading, status): kind "claim" (status None) or "finish"
# (status: the finish's result, False when stale).  Called outside any transaction.
Trace = Callable[[str, dict[str, Any], int, "str | bool | None"], None]


class Claimed(NamedTuple):
    """A ticket as claimed, and the clock reading of its claim (the delivery's first)."""

    ticket: w.Ticket
    first: int


class Sent(NamedTuple):
    """What a coroutine hands back: the outcome of one send, or why there is none."""

    claimed: Claimed
    outcome: str | None          # ok / retry / permanent; None: nothing to finish
    now_ms: int = 0              # the second clock reading
    delay_ms: int = 0
    failure: str | None = None   # "bad_acks" or "errors" when outcome is None


class Finish(NamedTuple):
    """One finish as the core's plans take it, on the ticket's current lease."""

    ticket: w.Ticket
    outcome: str
    now_ms: int
    delay_ms: int


class Phase(enum.Enum):
    """Where a run stands; it only ever moves forward."""

    CLAIMING = 1     # claims for idle coroutines and ahead of demand
    DRAINING = 2     # no more claims: what is held is delivered, what comes back is settled
    CLOSING = 3      # every coroutine is done: settle the last results, then stop
    CLOSED = 4


@dataclass
class Summary:
    """What a dispatcher run did."""

    claimed: int = 0
    commits: int = 0           # transactions (cycles) run
    done: int = 0
    retried: int = 0
    dead: int = 0              # every job that ended dead in this run's transactions:
    dead_permanent: int = 0    # rejected by the sink,
    dead_exhausted: int = 0    # out of attempts,
    dead_deadline: int = 0     # or past its deadline (finished, or by a claim's quarantine)
    stale: int = 0
    lost: int = 0              # held tickets whose extension came back stale: never finished
    bad_acks: int = 0
    errors: int = 0
    requests: int = 0
    resent: int = 0            # sends repeated under the same lease: the sink was not there
    extended: int = 0
    outages: int = 0           # the circuit breaker: times it opened,
    probes: int = 0            # sends it let through while open,
    paused_ms: int = 0         # and the time it was open

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def dead_unanswered(self) -> int:
        """Jobs that ended dead although the sink never rejected them."""
        return self.dead_exhausted + self.dead_deadline

    def ended(self, reasons: dict[str, int]) -> None:
        """Count the jobs a cycle ended dead, by reason."""
        for reason, n in reasons.items():
            self.dead += n
            name = f"dead_{reason}"
            setattr(self, name, getattr(self, name) + n)

    def fail(self, failure: str) -> None:
        """Count one send that ended without an outcome: a bad ACK or another error."""
        if failure == "bad_acks":
            self.bad_acks += 1
        else:
            self.errors += 1

    def count(self, status: str | bool) -> None:
        """Count one committed finish by its result."""
        if status is False:
            self.stale += 1
        elif status == "done":
            self.done += 1
        elif status == "pending":
            self.retried += 1


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

    def now(self, name: str = "clock reading") -> int:
        """A checked reading of the run's clock."""
        return w.check_now(self.clock(), name, self.limits)


class Committer:
    """Finishes in; claims, extensions and tickets out - one transaction per cycle."""

    def __init__(self, queue: AsyncQueue, settings: Settings, budget: int | None,
                 breaker: BreakerPolicy) -> None:
        self.queue, self.settings, self.budget = queue, settings, budget
        self.summary = Summary()
        self.breaker = Breaker(breaker, self.kick_now)
        self.phase = Phase.CLAIMING
        self.failure: BaseException | None = None
        self.held: dict[str, w.Ticket] = {}      # id -> the current lease of each held ticket
        self.capped: set[str] = set()            # held leases that end at their deadline
        self.ready: collections.deque[Claimed] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[Claimed | None]] = collections.deque()
        self.inbox: list[Sent] = []
        self.kick = asyncio.Event()
        self.taken = 0                           # tickets taken since the last cycle began
        self.rate = 0.0                          # tickets taken per second, over the last cycle
        self.period = self.txn_s = 0.0           # the last cycle: from start to start; its commit
        self.dry = False                         # the last claim came up short
        self.cycling = False                     # a transaction is in flight
        self.gathering = False                   # results are let gather (no kick per result)
        self.started = -math.inf                 # the event loop's time at the last cycle
        self.clock = asyncio.get_running_loop().time

    # --- the coroutines' side ----------------------------------------------------------

    async def take(self) -> Claimed | None:
        """The next ticket to send, or None when the run has none left for this coroutine."""
        while self.ready:
            claimed = self.ready.popleft()
            if self._holds(claimed.ticket):      # skip a ticket lost while it waited
                return self._taking(claimed)
        if self.phase is not Phase.CLAIMING and not self.cycling:
            return None                          # (a cycle in flight may still hand out)
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
        return max(0.0, (int(self.held[ticket["id"]]["lease_until"]) - self.settings.now()) / 1000)

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

    async def close(self, task: asyncio.Future[None]) -> None:
        """Every coroutine is done: let the committer settle the last results and end."""
        self.phase = Phase.CLOSING
        self.kick.set()
        await asyncio.wait([task])
        self.breaker.stop()
        counts = self.breaker.counts
        self.summary.outages, self.summary.probes = counts.outages, counts.probes
        self.summary.paused_ms = counts.paused_ms

    # --- the loop -----------------------------------------------------------------------

    async def run(self, until_empty: bool, follow: bool) -> None:
        try:
            while self.phase is not Phase.CLOSED:
                await self._step(until_empty, follow)
        except Exception as error:               # the run's failure; held jobs stay leased
            self.failure = error
            self.ready.clear()
            self.drain()

    async def _step(self, until_empty: bool, follow: bool) -> None:
        self.kick.clear()
        now = self.settings.now()
        want = self._want()
        due, wake_ms = self._due(now)
        if self.inbox or due or (want and not self.dry):
            pause = self._pause(now, due)
            if pause > 0:
                await self._gather(pause)
                return
            await self._cycle(now, due, want)
        elif self.phase is Phase.CLOSING:
            self.phase = Phase.CLOSED
        elif self.phase is Phase.CLAIMING and not self.held and await self._over(
                until_empty, follow):
            self.drain()
        else:
            await self._sleep(wake_ms)

    async def _over(self, until_empty: bool, follow: bool) -> bool:
        """Whether the run has nothing more to claim (nothing is held right now)."""
        if self.budget == 0:
            return True
        if not self.dry or follow:
            return False
        return not until_empty or not (await self.queue.read(w.SQL_ACTIVE))[0][0]

    async def _sleep(self, wake_ms: int | None) -> None:
        """Wait for a kick, the next lease to keep, or (after a dry claim) the idle poll."""
        if self.dry and self.phase is Phase.CLAIMING:
            wake_ms = min(wake_ms or self.settings.idle_ms, self.settings.idle_ms)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.kick.wait(), None if wake_ms is None else wake_ms / 1000)
        if not self.kick.is_set():
            self.dry = False                      # time to look for claimable jobs again

    def _pause(self, now: int, due: list[w.Ticket]) -> float:
        """Seconds to let more results gather before the next cycle (0 or less: cycle now)."""
        settings = self.settings
        if due or self.waiters or self.phase is not Phase.CLAIMING:
            return 0.0
        half = settings.lease_ms // 2
        for sent in self.inbox:
            current = self.held.get(sent.claimed.ticket["id"])
            if current is not None and current["lease_until"] - now <= half:
                return 0.0                        # its finish must not wait
        return self.started + settings.gather_s - self.clock()

    async def _gather(self, pause: float) -> None:
        """Wait ``pause`` seconds, or until a coroutine needs a ticket."""
        self.gathering = True
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.kick.wait(), pause)
        finally:
            self.gathering = False

    def _due(self, now: int) -> tuple[list[w.Ticket], int | None]:
        """Held leases ending within half a lease, and the ms until the next one will be."""
        if self.phase is Phase.CLOSING:
            return [], None                       # what the coroutines left is abandoned
        half = self.settings.lease_ms // 2
        returning = {sent.claimed.ticket["id"] for sent in self.inbox}
        due, wake = [], None
        for job_id, ticket in self.held.items():
            if job_id in returning or job_id in self.capped:
                continue
            left = ticket["lease_until"] - now - half
            if left <= 0:
                due.append(ticket)
            elif wake is None or left < wake:
                wake = left
        return due, wake

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

    def _want(self) -> int:
        """How many tickets to claim now: one per idle coroutine plus those kept ahead."""
        if self.phase is not Phase.CLAIMING:
            return 0
        if self.breaker.is_open:                  # one ticket to probe with, if none is held
            return int(not self.held and bool(self.waiters))    # (closing, it kicks us)
        want = len(self.waiters) + self._ahead() - len(self.ready)
        if self.budget is not None:
            want = min(want, self.budget)
        return max(0, min(want, 1024))

    async def _cycle(self, now: int, due: list[w.Ticket], want: int) -> None:
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
                finishes, due, self.settings.owner, now, self.settings.lease_ms, want)
        finally:
            self.cycling = False
            self.txn_s = self.clock() - started
        self.summary.commits += 1
        self.summary.ended(ended)
        if want:
            self.dry = len(tickets) < want
        self._settled(finishes, statuses)
        self._kept(now, due, extended)
        self._claimed(now, tickets)
        if self.phase is not Phase.CLAIMING:
            self._release_waiters()               # nothing more will be claimed for them

    def _finishes(self, sent: list[Sent]) -> list[Finish]:
        """Finishes on the current leases; results of lost tickets or failed sends drop."""
        finishes = []
        for claimed, outcome, now_ms, delay_ms, failure in sent:
            if failure is not None:
                self.summary.fail(failure)
            if not self._holds(claimed.ticket):
                continue                          # lost meanwhile: counted when it was
            if outcome is None:                   # no answer to record: the job stays leased
                self._release(claimed.ticket["id"])   # (or dies by its deadline) and is
                continue                              # reclaimed later
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
                self._release(old["id"])          # someone else may hold it now: never finish
                self.summary.lost += 1
                continue
            assert isinstance(new, dict)
            self.held[old["id"]] = new
            self.summary.extended += 1
            if new["lease_until"] < now + self.settings.lease_ms:
                self.capped.add(old["id"])        # at its deadline: no longer to extend

    def _claimed(self, now: int, tickets: list[w.Ticket]) -> None:
        if self.budget is not None:
            self.budget -= len(tickets)
        self.summary.claimed += len(tickets)
        for ticket in tickets:
            self.held[ticket["id"]] = ticket
            if self.settings.trace is not None:
                self.settings.trace("claim", ticket, now, None)
            self._hand_out(Claimed(ticket, now))

    def _release(self, job_id: str) -> None:
        self.held.pop(job_id, None)
        self.capped.discard(job_id)

    def _hand_out(self, claimed: Claimed) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():                 # a coroutine cancelled while waiting
                waiter.set_result(self._taking(claimed))
                return
        self.ready.append(claimed)

    def _release_waiters(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


async def deliver(committer: Committer, send: AsyncSend) -> None:
    """One delivery coroutine: take a ticket, send it, hand the result back; until None."""
    while (claimed := await committer.take()) is not None:
        try:
            sent = await send_until_answered(committer, send, claimed)
        except Exception:                         # a bad clock: the run fails, the job
            committer.hand_back(Sent(claimed, None, failure="errors"))   # stays leased
            committer.drain()
            raise
        committer.hand_back(sent)


async def send_until_answered(committer: Committer, send: AsyncSend, claimed: Claimed) -> Sent:
    """Send a ticket, and again under the same lease while the sink is not there.

    Classified like ``run_once``; an ``Unavailable`` failure is not an outcome: the send
    goes again (paced by the retry policy, gated by the breaker) for as long as the run
    keeps the lease - up to the job's deadline.
    """
    settings, breaker, summary = committer.settings, committer.breaker, committer.summary
    ticket, again = claimed.ticket, 0
    while True:
        probe = await breaker.admit(committer.lease_left_s(ticket)) if breaker.is_open else False
        if (again or probe is not False) and not committer.keeps(ticket, settings.now()):
            breaker.record(probe, None)           # (a first send's ticket was just checked)
            return Sent(claimed, None)            # lost, or at its deadline: no answer
        if probe is None:
            continue                              # the lease was extended meanwhile
        summary.requests += 1
        if again:
            summary.resent += 1
        again += 1
        jitter = w.check_jitter(settings.jitter())
        try:
            ack = await send(w.fresh_event(ticket), ticket["token"])
            outcome = w.judge_send(ticket, jitter, ack, None, settings.retry, settings.limits)
        except w.Unavailable:
            breaker.record(probe, True)
            if not breaker.is_open:
                await asyncio.sleep(settings.retry.delay(min(again, 16), jitter,
                                                         settings.limits) / 1000)
            continue
        except (w.Retryable, w.Permanent) as error:
            outcome = w.judge_send(ticket, jitter, None, error, settings.retry, settings.limits)
        except Exception as error:                # stays leased; reclaimed after the lease
            breaker.record(probe, False if isinstance(error, w.BadAck) else None)
            return Sent(claimed, None, failure="bad_acks" if isinstance(error, w.BadAck)
                        else "errors")
        breaker.record(probe, False)
        return Sent(claimed, *outcome_at(committer, claimed, outcome))


def outcome_at(committer: Committer, claimed: Claimed,
               outcome: tuple[str, int]) -> tuple[str, int, int]:
    """The outcome with the delivery's second clock reading: ``(outcome, now_ms, delay)``."""
    now = w.second_reading(committer.settings.clock, claimed.first, committer.settings.limits)
    return outcome[0], now, outcome[1]


class Dispatcher:
    """Many delivery coroutines over one AsyncQueue, each job following ``run_once``'s contract.

    One committer task runs every transaction (see ``Committer``); ``concurrency``
    coroutines only send.  ``prefetch`` fixes how many tickets are kept claimed ahead of
    demand (default: adaptive).  ``gather_ms`` (at most a tenth of the lease is used) is
    how long results may wait for more while every coroutine is busy; 0 settles each
    batch as soon as the last transaction ends.  ``retry`` is the delay before a job's next
    attempt (and between re-sends while the sink is away); ``breaker`` when to pause for an
    outage.
    Ranges are the queue's ``limits``.  ``summary`` is the current (or last) run's.
    """

    def __init__(self, queue: AsyncQueue, send: AsyncSend, *, owner: str, concurrency: int = 64,
                 lease_ms: int = 5000, clock: Callable[[], int] = w.epoch_ms,
                 jitter: Callable[[], float] = random.random, grace_s: float = 5.0,
                 idle_ms: int = 20, gather_ms: int = 10, trace: Trace | None = None,
                 prefetch: int | None = None,
                 retry: w.Retry = w.RUN_ONCE_RETRY,
                 breaker: BreakerPolicy = DEFAULT_BREAKER) -> None:
        limits = queue.limits
        w.check_run_args(owner, clock, send, 0.5, lease_ms, limits)
        w.check_int(concurrency, "concurrency", 1, 1024)
        w.check_int(idle_ms, "idle_ms", 1, 60_000)
        w.check_int(gather_ms, "gather_ms", 0, 1000)
        if type(grace_s) not in (int, float) or not 0 <= grace_s <= 3600:
            raise ValueError(f"grace_s must be a number of seconds in 0..3600: {grace_s!r}")
        retry.check(limits)
        breaker.check()
        if prefetch is not None:
            w.check_int(prefetch, "prefetch", 0, 1024)
        timeout_s = getattr(send, "timeout_s", None)
        if timeout_s is not None and timeout_s * 1000 >= lease_ms:
            raise ValueError(f"the sender's timeout ({timeout_s}s) must be below the lease "
                             f"({lease_ms}ms): a late ACK would arrive after the lease ended")
        self.queue, self.send, self.grace_s, self.breaker = queue, send, grace_s, breaker
        self.settings = Settings(owner, concurrency, lease_ms, clock, jitter, idle_ms, gather_ms,
                                 prefetch, trace, retry, limits)
        self.summary = Summary()
        self._breaker: Breaker | None = None

    @property
    def paused(self) -> bool:
        """Whether the current run is paused by its circuit breaker (the sink is away)."""
        return self._breaker is not None and self._breaker.is_open

    def snapshot(self) -> dict[str, int]:
        """The current (or last) run's counts so far; the circuit breaker's are live too
        (``summary`` gets them when the run ends)."""
        counts = self.summary.as_dict()
        if self._breaker is not None:
            live = self._breaker.counts
            counts.update(outages=live.outages, probes=live.probes,
                          paused_ms=self._breaker.paused_ms_so_far())
        return counts

    async def run(self, *, until_empty: bool = True, max_jobs: int | None = None,
                  follow: bool = False) -> Summary:
        """Deliver until the queue holds no pending or leased job (or ``max_jobs`` claims).

        ``until_empty=False``: stop as soon as nothing is claimable.  ``follow=True``: never
        stop on an empty queue; poll until cancelled (or ``max_jobs`` claims).  On
        cancellation: claim nothing more, let sends in flight (and tickets held) finish
        within ``grace_s``, commit their results, and re-raise.
        """
        if max_jobs is not None:
            w.check_int(max_jobs, "max_jobs", 0, 10**12)
        committer = Committer(self.queue, self.settings, max_jobs, self.breaker)
        self.summary, self._breaker = committer.summary, committer.breaker
        loop = asyncio.ensure_future(committer.run(until_empty, follow))
        workers = [asyncio.ensure_future(deliver(committer, self.send))
                   for _ in range(self.settings.concurrency)]
        try:
            await asyncio.wait(workers)    # unlike gather, a cancelled wait spares the workers
        except asyncio.CancelledError:
            committer.drain()
            _, late = await asyncio.wait(workers, timeout=self.grace_s)
            for task in late:              # abandoned jobs stay leased and are reclaimed later
                task.cancel()
            await asyncio.wait(workers)
            await committer.close(loop)
            raise
        await committer.close(loop)
        for task in workers:
            task.result()                  # a coroutine's unexpected failure is the run's
        if committer.failure is not None:
            raise committer.failure
        return self.summary
