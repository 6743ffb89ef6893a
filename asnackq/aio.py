"""The asyncio layer: the core's plans driven through aiosqlite, and a concurrent Dispatcher.

Rules of this module:

* No state machine here: every transition is a ``worker.plan_*`` plan, and even the driver
  loop is the core's own (``worker._transact``): ``pump`` runs BEGIN and the whole plan in
  aiosqlite's thread in one call (``Connection._execute``, present since aiosqlite 0.20;
  the test suite fails loudly if a release drops it).
* One connection and one ``asyncio.Lock`` per queue: two coroutines' transactions never
  interleave.  A transaction runs in its own task under ``asyncio.shield``: a cancelled
  caller waits for the COMMIT or ROLLBACK, then re-raises - never a split write.
* No transaction is ever open across a network await: sends happen between plans.
* ``SQLITE_BUSY`` from other processes is retried at BEGIN (nothing is written yet) with
  a bounded, jittered backoff (in the DB thread, never blocking the event loop), then
  surfaces as ``QueueBusy``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiosqlite

from asnackq.core import worker as w

__all__ = ["AsyncQueue", "Dispatcher", "QueueBusy", "Summary", "epoch_ms"]

AsyncSend = Callable[..., Awaitable[object]]
# trace(kind, ticket, clock reading, status): kind "claim" (status None) or "finish"
# (status: the finish's result, False when stale).  Called outside any transaction.
Trace = Callable[[str, dict[str, Any], int, "str | bool | None"], None]
# A ticket, the clock reading it was claimed at, and the loop time of that reading.
Claimed = tuple[dict[str, Any], int, float]


class QueueBusy(sqlite3.OperationalError):
    """Raised when the queue file stayed locked by other processes beyond the retry bound."""


def epoch_ms() -> int:
    """The default clock: milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


def check_async_fault(fault: object) -> w.Fault:
    """A fault hook must be a plain callable: one returning a coroutine is refused."""
    if inspect.iscoroutinefunction(fault):
        raise TypeError("fault must be a plain callable, not a coroutine function")
    return w.check_fault(fault)


def call_fault(fault: w.Fault, point: str) -> None:
    if fault is None:
        return
    result = fault(point)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"fault returned an awaitable at {point!r}; hooks must be plain calls")


def _begin(con: sqlite3.Connection, attempts: int) -> None:
    """BEGIN IMMEDIATE, retrying SQLITE_BUSY with a bounded, jittered backoff.

    Runs in aiosqlite's thread: the backoff sleeps there, never on the event loop.
    """
    for attempt in range(attempts):
        try:
            con.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) and "busy" not in str(error):
                raise
            if attempt == attempts - 1:
                raise QueueBusy(f"queue locked after {attempts} attempts: {error}") from error
            time.sleep(random.uniform(0, 0.01 * 2**attempt))


def _transaction(con: sqlite3.Connection, plan: w.Plan, fault: w.Fault, attempts: int) -> Any:
    """One whole transaction in aiosqlite's thread: BEGIN (with retries), then the core's loop."""
    _begin(con, attempts)
    return w._transact(con, plan, fault)


async def open_db(path: Any, schema: tuple[str, ...], busy_s: float,
                  attempts: int = 8) -> aiosqlite.Connection:
    """Open a DB file with the core's settings, creating ``schema`` through the core's plan.

    The schema goes first: its BEGIN waits out a file another process holds with the same
    bounded backoff as every transaction (``QueueBusy`` after it); once the schema is
    read, the PRAGMAs need no lock.
    """
    db = await aiosqlite.connect(path, timeout=busy_s, isolation_level=None)
    try:
        await pump(db, w.plan_schema(schema), None, attempts)
        for pragma in w.PRAGMAS:
            await db.execute(pragma)
    except BaseException:
        await db.close()
        raise
    return db


async def pump(db: aiosqlite.Connection, plan: w.Plan, fault: w.Fault,
               attempts: int = 8) -> Any:
    """Run ``plan`` in one BEGIN IMMEDIATE transaction on ``db``.

    The whole transaction - BEGIN with its busy retries, then the core's own driver loop
    ``worker._transact`` - runs in aiosqlite's thread in one call: one thread hop per
    transaction, not one per statement, and nothing else can run on the connection between
    its statements.  Hooks run there too, checked by ``call_fault``.
    """
    checked = None if fault is None else functools.partial(call_fault, fault)
    return await db._execute(_transaction, db._conn, plan, checked, attempts)  # type: ignore[no-untyped-call]


class AsyncQueue:
    """A queue file driven through aiosqlite: the same validation, results and hooks as the core."""

    def __init__(self, db: aiosqlite.Connection, attempts: int = 8) -> None:
        self._db = db
        self._attempts = attempts
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: Any, *, busy_s: float = 1.0, attempts: int = 8) -> AsyncQueue:
        """Open a queue file (``open_queue``'s format and settings); close it with ``close()``.

        A locked file is waited on for ``busy_s`` per try (SQLite's busy timeout), and BEGIN
        is tried ``attempts`` times with a jittered backoff before ``QueueBusy`` is raised.
        """
        filename = w.check_queue_path(path)
        if not 0 < busy_s <= 60:
            raise ValueError(f"busy_s must be in (0, 60]: {busy_s!r}")
        w.check_int(attempts, "attempts", 1, 100)
        return cls(await open_db(filename, w.SCHEMA, busy_s, attempts), attempts)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, path: Any, *, busy_s: float = 1.0,
                   attempts: int = 8) -> AsyncIterator[AsyncQueue]:
        """``async with AsyncQueue.open(path) as q:`` - closed on exit."""
        queue = await cls.connect(path, busy_s=busy_s, attempts=attempts)
        try:
            yield queue
        finally:
            await queue.close()

    async def close(self) -> None:
        async with self._lock:
            await self._db.close()

    @property
    def in_transaction(self) -> bool:
        return bool(self._db.in_transaction)

    async def _run(self, plan: w.Plan, fault: w.Fault = None) -> Any:
        """Run one plan under the lock, shielded: cancellation never splits the transaction."""
        async def locked() -> Any:
            async with self._lock:
                return await pump(self._db, plan, fault, self._attempts)

        task = asyncio.ensure_future(locked())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])     # let COMMIT or ROLLBACK land, then re-raise
            raise

    async def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """A read-only query outside any write transaction."""
        async with self._lock:
            return [tuple(row) for row in await self._db.execute_fetchall(sql, params)]

    async def enqueue(self, event: dict[str, Any], now_ms: int, ttl_ms: int,
                      max_attempts: int = 3) -> bool:
        return bool(await self._run(w.plan_enqueue(event, now_ms, ttl_ms, max_attempts)))

    async def enqueue_many(self, items: list[tuple[dict[str, Any], int, int]],
                           now_ms: int) -> list[bool | w.Conflict]:
        results: list[bool | w.Conflict] = await self._run(w.plan_enqueue_many(items, now_ms))
        return results

    async def claim(self, owner: str, now_ms: int, lease_ms: int = 1000,
                    fault: w.Fault = None) -> w.Ticket | None:
        plan = w.plan_claim(owner, now_ms, lease_ms)
        result: w.Ticket | None = await self._run(plan, check_async_fault(fault))
        return result

    async def claim_many(self, owner: str, now_ms: int, lease_ms: int,
                         count: int) -> list[w.Ticket]:
        result: list[w.Ticket] = await self._run(w.plan_claim_many(owner, now_ms, lease_ms, count))
        return result

    async def finish(self, ticket: w.Ticket, outcome: str, now_ms: int, delay_ms: int = 0,
                     fault: w.Fault = None) -> str | bool:
        plan = w.plan_finish(ticket, outcome, now_ms, delay_ms)
        result: str | bool = await self._run(plan, check_async_fault(fault))
        return result

    async def finish_many(self, results: list[tuple[w.Ticket, str, int, int]]) -> list[str | bool]:
        statuses: list[str | bool] = await self._run(w.plan_finish_many(results))
        return statuses

    async def finish_and_claim(self, results: list[tuple[w.Ticket, str, int, int]], owner: str,
                               now_ms: int, lease_ms: int,
                               count: int) -> tuple[list[str | bool], list[w.Ticket]]:
        plan = w.plan_finish_and_claim(results, owner, now_ms, lease_ms, count)
        outcome: tuple[list[str | bool], list[w.Ticket]] = await self._run(plan)
        return outcome

    async def extend(self, ticket: w.Ticket, now_ms: int, lease_ms: int,
                     fault: w.Fault = None) -> w.Ticket | bool:
        plan = w.plan_extend(ticket, now_ms, lease_ms)
        result: w.Ticket | bool = await self._run(plan, check_async_fault(fault))
        return result

    async def redrive(self, job_id: str, now_ms: int, ttl_ms: int, note: str,
                      fault: w.Fault = None) -> bool:
        plan = w.plan_redrive(job_id, now_ms, ttl_ms, note)
        return bool(await self._run(plan, check_async_fault(fault)))

    async def run_once(self, owner: str, clock: Callable[[], int],
                       send: Callable[[dict[str, Any]], Awaitable[object]], jitter: float,
                       lease_ms: int = 1000) -> dict[str, Any] | None:
        """The core's ``run_once`` with an async ``send``, awaited outside any transaction."""
        w.check_run_args(owner, clock, send, jitter, lease_ms)
        first = w.check_now(clock(), "first clock reading")
        ticket = await self.claim(owner, first, lease_ms)
        if ticket is None:
            return None
        mine = dict(ticket)
        outcome, delay = await classify(send, mine, jitter)
        now = w.second_reading(clock, first)
        return w.delivery_result(mine, await self.finish(dict(mine), outcome, now, delay))


async def classify(send: AsyncSend, ticket: w.Ticket, jitter: float,
                   *extra: Any) -> tuple[str, int]:
    """The async twin of ``worker.classify``: the judgement itself is ``worker.judge_send``."""
    try:
        ack = await send(w.fresh_event(ticket), *extra)
    except (w.Retryable, w.Permanent) as error:
        return w.judge_send(ticket, jitter, error=error)
    return w.judge_send(ticket, jitter, ack)


@dataclass
class Summary:
    """What a dispatcher run did."""

    claimed: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    stale: int = 0
    bad_acks: int = 0
    errors: int = 0
    requests: int = 0
    extended: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Dispatcher:
    """Many delivery coroutines over one AsyncQueue, each job following ``run_once``'s contract.

    One committer task owns every transaction: it commits the finishes that have arrived and
    claims tickets for idle coroutines (plus some ahead of demand: see ``_ahead``) in one
    ``finish_and_claim`` transaction - each ticket fenced on its own, each claim its own
    token, exactly as sequential calls would be.  Coroutines only send: a coroutine hands its
    result to the committer and takes its next ticket without waiting for the commit.
    """

    def __init__(self, queue: AsyncQueue, send: AsyncSend, *, owner: str, concurrency: int = 64,
                 lease_ms: int = 5000, clock: Callable[[], int] = epoch_ms,
                 jitter: Callable[[], float] = random.random, grace_s: float = 5.0,
                 idle_ms: int = 20, trace: Trace | None = None,
                 prefetch: int | None = None) -> None:
        w.check_run_args(owner, clock, send, 0.5, lease_ms)
        w.check_int(concurrency, "concurrency", 1, 1024)
        timeout_s = getattr(send, "timeout_s", None)
        if timeout_s is not None and timeout_s * 1000 >= lease_ms:
            raise ValueError(f"the sender's timeout ({timeout_s}s) must be below the lease "
                             f"({lease_ms}ms): a late ACK would arrive after the lease ended")
        self.queue, self.send, self.owner = queue, send, owner
        self.concurrency, self.lease_ms, self.clock = concurrency, lease_ms, clock
        self.jitter, self.grace_s, self.idle_ms = jitter, grace_s, idle_ms
        self.trace = trace
        if prefetch is not None:
            w.check_int(prefetch, "prefetch", 0, 1024)
        self.prefetch = prefetch
        self._ahead_max = min(8 * concurrency, 1024)
        self.summary = Summary()
        self._reset(None)

    def _reset(self, budget: int | None) -> None:
        self._budget = budget
        self._ready: collections.deque[Claimed] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Claimed | None]] = collections.deque()
        self._finishes: list[tuple[w.Ticket, str, int, int]] = []
        self._held = 0                    # tickets claimed and not yet settled or given up
        self._taken = self._demand = 0    # tickets taken by coroutines: now, last cycle
        self._kick = asyncio.Event()
        self._dry = False                 # the last claim came up short: wait idle_ms
        self._claiming = False            # a claim transaction is in flight
        self._stopping = self._ended = self._closing = False
        self._failure: BaseException | None = None

    async def run(self, *, until_empty: bool = True, max_jobs: int | None = None,
                  follow: bool = False) -> Summary:
        """Deliver until the queue holds no pending or leased job (or ``max_jobs`` claims).

        ``until_empty=False``: stop as soon as nothing is claimable.  ``follow=True``: never
        stop on an empty queue; poll until cancelled (or ``max_jobs`` claims).
        """
        self._reset(max_jobs)
        committer = asyncio.ensure_future(self._commit_loop(until_empty, follow))
        workers = [asyncio.ensure_future(self._work()) for _ in range(self.concurrency)]
        try:
            await asyncio.wait(workers)    # unlike gather, a cancelled wait spares the workers
        except asyncio.CancelledError:
            self._stop()                   # stop claiming; let in-flight sends end
            _, late = await asyncio.wait(workers, timeout=self.grace_s)
            for task in late:              # abandoned jobs stay leased and are reclaimed later
                task.cancel()
            await asyncio.wait(workers)
            await self._close(committer)
            raise
        await self._close(committer)
        for task in workers:
            task.result()                  # a worker's unexpected failure is the run's failure
        if self._failure is not None:
            raise self._failure
        return self.summary

    async def _close(self, committer: asyncio.Future[None]) -> None:
        """Let the committer settle the last finishes, then end it."""
        self._closing = True
        self._kick.set()
        await asyncio.wait([committer])

    def _stop(self) -> None:
        self._stopping = True
        self._release_waiters()

    def _end(self) -> None:
        self._ended = True
        self._release_waiters()

    def _release_waiters(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def _next(self) -> Claimed | None:
        """The next ticket to deliver, or None when the run is over for this coroutine."""
        if self._ready:
            self._taken += 1
            return self._ready.popleft()
        if (self._stopping or self._ended) and not self._claiming:
            return None                    # (a claim in flight still hands its tickets out)
        waiter: asyncio.Future[Claimed | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._kick.set()
        return await waiter

    def _ahead(self) -> int:
        """How many ready tickets to keep ahead of demand.

        ``prefetch`` if given; otherwise twice what the coroutines took during the last
        cycle (so the ready tickets outlast the next transaction, however long commits take
        on this disk), at least a quarter of the concurrency, at most eight per coroutine.
        """
        if self.prefetch is not None:
            return self.prefetch
        return max(self.concurrency // 4, min(2 * self._demand, self._ahead_max))

    def _want(self) -> int:
        """How many tickets to claim now: one per idle coroutine plus those kept ahead."""
        if self._stopping or self._ended or self._closing:
            return 0
        want = len(self._waiters) + self._ahead() - len(self._ready)
        if self._budget is not None:
            want = min(want, self._budget)
        return max(0, min(want, 1024))

    async def _commit_loop(self, until_empty: bool, follow: bool) -> None:
        try:
            while True:
                self._kick.clear()
                finishes, self._finishes = self._finishes, []
                self._demand, self._taken = self._taken, 0
                want = self._want()
                if finishes or (want and not self._dry):
                    await self._cycle(finishes, want)
                    continue
                if self._closing:
                    return
                if self._held == 0 and not self._ended and (
                        self._budget == 0 or (self._dry and not follow and (
                            not until_empty or not await self._active()))):
                    self._end()
                    continue
                timeout = self.idle_ms / 1000 if self._dry else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), timeout)
                if timeout is not None and not self._kick.is_set():
                    self._dry = False      # time to look for claimable jobs again
        except Exception as error:         # the run's failure; unsettled jobs stay leased
            self._failure = error
            self._end()

    async def _cycle(self, finishes: list[tuple[w.Ticket, str, int, int]], want: int) -> None:
        """One transaction: settle ``finishes``, claim up to ``want`` tickets."""
        now, at = 0, asyncio.get_running_loop().time()
        if want:
            now = w.check_now(self.clock(), "first clock reading")
            self._claiming = True
            try:
                statuses, tickets = await self.queue.finish_and_claim(
                    finishes, self.owner, now, self.lease_ms, want)
            finally:
                self._claiming = False
            self._dry = len(tickets) < want
        else:
            statuses, tickets = await self.queue.finish_many(finishes), []
        for (ticket, outcome, at, _), status in zip(finishes, statuses, strict=True):
            self._held -= 1
            if self.trace is not None:
                self.trace("finish", ticket, at, status)
            self._count(outcome, status)
        if self._budget is not None:
            self._budget -= len(tickets)
        self._held += len(tickets)
        self.summary.claimed += len(tickets)
        for ticket in tickets:
            if self.trace is not None:
                self.trace("claim", ticket, now, None)
            self._hand_out((ticket, now, at))
        if self._stopping or self._ended:
            self._release_waiters()        # nothing more will be claimed for them

    def _hand_out(self, claimed: Claimed) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():          # a coroutine cancelled while waiting is skipped
                waiter.set_result(claimed)
                self._taken += 1
                return
        self._ready.append(claimed)

    async def _work(self) -> None:
        while (claimed := await self._next()) is not None:
            await self._deliver(*claimed)

    async def _active(self) -> bool:
        rows = await self.queue.read(w.SQL_ACTIVE)
        return bool(rows[0][0])

    async def _deliver(self, ticket: w.Ticket, first: int, claimed_at: float) -> None:
        try:
            ticket, (outcome, delay) = await self._send_extending(ticket, claimed_at)
        except Exception as error:         # stays leased; reclaimed after the lease
            if isinstance(error, w.BadAck):
                self.summary.bad_acks += 1
            else:
                self.summary.errors += 1
            self._held -= 1
            self._kick.set()
            return
        now = w.second_reading(self.clock, first)
        self._finishes.append((ticket, outcome, now, delay))
        self._kick.set()

    async def _send_extending(self, ticket: w.Ticket,
                              claimed_at: float) -> tuple[w.Ticket, tuple[str, int]]:
        """Send once; while the send outlives half its lease, extend the lease (fenced).

        A timer starts the extender only for a send still running half a lease after the
        claim (time spent waiting as a prefetched ticket counts), so a quick send costs no
        extra task.
        """
        self.summary.requests += 1
        jitter = w.check_jitter(self.jitter())
        held = [ticket]
        sent = asyncio.Event()
        extender: asyncio.Future[None] | None = None

        def start() -> None:
            nonlocal extender
            extender = asyncio.ensure_future(self._keep_leased(held, sent))

        loop = asyncio.get_running_loop()
        timer = loop.call_at(claimed_at + self.lease_ms / 2000, start)
        try:
            result = await classify(self.send, ticket, jitter, ticket["token"])
        finally:
            timer.cancel()
            sent.set()
            if extender is not None:
                await asyncio.wait([extender])      # an extension under way lands first
        failure = extender.exception() if extender is not None else None
        if failure is not None:
            raise failure                           # the job stays leased: reclaimed later
        return held[0], result

    async def _keep_leased(self, held: list[w.Ticket], sent: asyncio.Event) -> None:
        while not sent.is_set():
            longer = await self.queue.extend(held[0], w.check_now(self.clock()), self.lease_ms)
            if longer is not False:
                assert isinstance(longer, dict)
                held[0] = longer
                self.summary.extended += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sent.wait(), self.lease_ms / 2000)

    def _count(self, outcome: str, status: str | bool) -> None:
        if status is False:
            self.summary.stale += 1
        elif status == "done":
            self.summary.done += 1
        elif status == "pending":
            self.summary.retried += 1
        else:
            self.summary.dead += 1
