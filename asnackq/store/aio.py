"""The asyncio layer: the core's plans, driven off the event loop (the Dispatcher: ``dispatch``).

Rules of this module:

* No state machine and no driver here: every transition is a ``worker.plan_*`` plan, run
  by a store's driver: on a file aiosqlite's (``asnackq.store.sqlite_aio``), on a
  ``postgresql://`` URL psycopg's (``asnackq.store.pg``); the same face, the same plans.
* One connection and one ``asyncio.Lock`` per queue: two coroutines' transactions never
  interleave.  A transaction runs in its own task under ``asyncio.shield``: a cancelled
  caller waits for the COMMIT or ROLLBACK, then re-raises - never a split write.
* No transaction is ever open across a network await: sends happen between plans.
* A queue on a connection the application owns (``AsyncQueue.within``) runs its intakes
  inside the application's open transaction (``asnackq.store.borrowed``) and refuses the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from asnackq.core import rate as r
from asnackq.core import tracing
from asnackq.core import worker as w
from asnackq.store import job_traces
from asnackq.store.budget import DEFAULT_MAX_ATTEMPTS, Budget, Item, intakes
from asnackq.store.opening import Store, open_store
from asnackq.store.outage import Health
from asnackq.store.sqlite_aio import QueueBusy
from asnackq.store.targets import is_url

__all__ = ["NOT_AN_INTAKE", "AsyncQueue", "AsyncSend", "Clock", "QueueBusy"]

T = TypeVar("T")
AsyncSend = Callable[..., Awaitable[object]]
Clock = Callable[[], int]
NOT_AN_INTAKE = (
    "on the application's connection a queue only enqueues: claims, finishes and the "
    "Dispatcher are the queue's own transactions (open it with AsyncQueue.connect)"
)


def check_async_fault(fault: object) -> w.Fault:
    """A fault hook must be a plain callable: one returning a coroutine is refused."""
    if inspect.iscoroutinefunction(fault):
        raise TypeError("fault must be a plain callable, not a coroutine function")
    return w.check_fault(fault)


class AsyncQueue:
    """A queue driven through a ``Store``: the same validation, results and hooks as the core.

    The queue keeps a clock and a budget for the calls that name none: ``clock`` (wall time,
    ``epoch_ms``, by default; the Dispatcher's too unless it is given its own) is read for
    a missing ``now_ms``; ``ttl_ms`` (a day, or the ``limits``' longest ttl if shorter) and
    ``max_attempts`` (5) are a new job's budget when its intake names none.  A day outlasts
    an overnight outage of the partner within ``PRODUCT``'s limits; five attempts suffice
    because the Dispatcher's breaker keeps a sink outage from spending attempts, so
    attempts count only real refusals and timeouts (``asnackq.store.budget``).
    """

    def __init__(
        self,
        db: Store,
        limits: w.Limits = w.PRODUCT,
        intakes_only: bool = False,
        *,
        clock: Clock = w.epoch_ms,
        budget: Budget | None = None,
    ) -> None:
        """A queue on an open ``Store``; ``connect``, ``open`` and ``within`` make one.
        ``budget``: as checked by ``check_defaults`` (None: the default ttl and attempts)."""
        if budget is None:
            budget = check_defaults(clock, None, DEFAULT_MAX_ATTEMPTS, limits)
        self.budget = budget
        self._db = db
        self._lock = asyncio.Lock()
        self.limits = limits
        self.clock = clock
        self.intakes_only = intakes_only  # on the application's connection: see ``within``
        self.tracer = tracing.tracer()  # None: intakes are not traced (``asnackq.core.tracing``)

    @classmethod
    async def connect(
        cls,
        path: Any,
        *,
        busy_s: float = 1.0,
        attempts: int = 8,
        limits: w.Limits = w.PRODUCT,
        clock: Clock = w.epoch_ms,
        ttl_ms: int | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> AsyncQueue:
        """Open a queue file (``open_queue``'s format and settings) or a ``postgresql://`` URL
        (``asnackq.store.pg``: the same tables in that database); close it with ``close()``.

        ``limits``: the ranges accepted (default ``PRODUCT``: ttl up to 30 days, leases and
        delays up to an hour; ``worker.CONTRACT`` gives the graded functions' ranges).
        ``clock``, ``ttl_ms``, ``max_attempts``: the time and budget of calls that name
        none (see the class), checked here against ``limits``.

        A locked file is waited on for ``busy_s`` per try (SQLite's busy timeout), and BEGIN
        is tried ``attempts`` times with a jittered backoff before ``QueueBusy`` is raised.
        """
        target = path if is_url(path) else w.check_queue_path(path)
        if not 0 < busy_s <= 60:
            raise ValueError(f"busy_s must be in (0, 60]: {busy_s!r}")
        w.check_int(attempts, "attempts", 1, 100)
        defaults = check_defaults(clock, ttl_ms, max_attempts, limits)  # before any change
        store = await open_store(target, w.SCHEMA, busy_s, attempts)
        return cls(store, limits, False, clock=clock, budget=defaults)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        path: Any,
        *,
        busy_s: float = 1.0,
        attempts: int = 8,
        limits: w.Limits = w.PRODUCT,
        clock: Clock = w.epoch_ms,
        ttl_ms: int | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> AsyncIterator[AsyncQueue]:
        """``async with AsyncQueue.open(path) as q:`` - ``connect``, closed on exit."""
        queue = await cls.connect(
            path,
            busy_s=busy_s,
            attempts=attempts,
            limits=limits,
            clock=clock,
            ttl_ms=ttl_ms,
            max_attempts=max_attempts,
        )
        try:
            yield queue
        finally:
            await queue.close()

    @classmethod
    async def within(
        cls,
        con: object,
        *,
        attempts: int = 8,
        limits: w.Limits = w.PRODUCT,
        clock: Clock = w.epoch_ms,
        ttl_ms: int | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> AsyncQueue:
        """A queue on a connection the application owns: an ``aiosqlite.Connection`` on the
        queue's file or a psycopg ``AsyncConnection`` (``asnackq.store.borrowed``).

        ``enqueue`` and ``enqueue_many`` run inside the application's open transaction and
        commit with it; claims, finishes and the Dispatcher are refused (they are the
        queue's own transactions: open the queue with ``connect`` for them).  The tables are
        created here, in a transaction of their own.  ``clock``, ``ttl_ms``,
        ``max_attempts``: as ``connect``'s.
        """
        from asnackq.store import borrowed

        w.check_int(attempts, "attempts", 1, 100)
        defaults = check_defaults(clock, ttl_ms, max_attempts, limits)  # before any change
        store = await borrowed.adopt(con, w.SCHEMA, attempts)
        return cls(store, limits, True, clock=clock, budget=defaults)

    async def close(self) -> None:
        """Close the queue's connection (on the application's connection: nothing)."""
        async with self._lock:
            await self._db.close()

    @property
    def in_transaction(self) -> bool:
        return bool(self._db.in_transaction)

    def give_up_after(self, seconds: float) -> None:
        """Wait for an absent database ``seconds`` from now at most: a COMMIT whose answer
        was lost is looked up until then (``CommitUnknown`` after; a file: nothing to do)."""
        give_up = getattr(self._db, "give_up_after", None)
        if give_up is not None:
            give_up(seconds)

    @property
    def health(self) -> Health | None:
        """The store's session and its outages (a ``postgresql://`` store's; None for a file)."""
        return getattr(self._db, "health", None)

    async def _run(
        self, make: Callable[[], w.Plan[T]], fault: w.Fault = None, intake: bool = False
    ) -> T:
        """Run one plan under the lock, shielded: cancellation never splits the transaction.

        ``make`` builds the plan, validating it before any I/O (a store may build it again
        to retry a transaction that met a concurrent one).
        """
        built = [make()]  # the first try runs the plan validated here
        if self.intakes_only and not intake:
            raise ValueError(NOT_AN_INTAKE)

        def again() -> w.Plan[T]:
            return built.pop() if built else make()

        async def locked() -> T:
            async with self._lock:
                result: T = await self._db.run(again, fault)
                return result

        task = asyncio.ensure_future(locked())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])  # let COMMIT or ROLLBACK land, then re-raise
            raise

    async def read(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> list[tuple[Any, ...]]:
        """A read-only query outside any write transaction."""
        async with self._lock:
            return await self._db.read(sql, params)

    def _now(self, now_ms: int | None = None) -> int:
        """``now_ms``, or the queue's clock's reading when it is None."""
        return self.clock() if now_ms is None else now_ms

    async def enqueue(
        self,
        event: dict[str, Any],
        now_ms: int | None = None,
        ttl_ms: int | None = None,
        max_attempts: int | None = None,
    ) -> bool:
        """Enqueue ``event`` (True inserted, False already there); None: the queue's clock
        and budget."""
        ttl, tries = self.budget.fill(ttl_ms, max_attempts)
        make = partial(w.plan_enqueue, event, self._now(now_ms), ttl, tries, limits=self.limits)
        if self.tracer is not None:
            return bool((await self._traced(make, [(event, ttl, tries)]))[0])
        return bool(await self._run(make, intake=True))

    async def enqueue_many(
        self, items: Sequence[Item], now_ms: int | None = None
    ) -> list[bool | w.Conflict]:
        """Enqueue plain events (the queue's budget) or ``(event, ttl_ms, max_attempts)``
        triples, mixed as needed, in one transaction."""
        triples = intakes(items, self.budget)
        make = partial(w.plan_enqueue_many, triples, self._now(now_ms), limits=self.limits)
        if self.tracer is not None:
            return await self._traced(make, triples)
        results: list[bool | w.Conflict] = await self._run(make, intake=True)
        return results

    async def _traced(
        self, make: Callable[[], w.Plan[Any]], triples: list[tuple[object, object, object]]
    ) -> list[Any]:
        """An intake with a PRODUCER span per job, each span's context stored with its job
        in the intake's transaction (``asnackq.store.job_traces``)."""
        make()  # validated before any span
        assert self.tracer is not None
        with job_traces.producing(self.tracer, job_traces.event_ids(triples)) as spans:
            result = await self._run(spans.plan(make), intake=True)
            results = result if isinstance(result, list) else [result]
            spans.settled(results)
        return results

    async def claim(
        self, owner: str, now_ms: int, lease_ms: int = 1000, fault: w.Fault = None
    ) -> w.Ticket | None:
        make = partial(w.plan_claim, owner, now_ms, lease_ms, limits=self.limits)
        result: w.Ticket | None = await self._run(make, check_async_fault(fault))
        return result

    async def claim_many(
        self, owner: str, now_ms: int, lease_ms: int, count: int
    ) -> list[w.Ticket]:
        make = partial(w.plan_claim_many, owner, now_ms, lease_ms, count, limits=self.limits)
        result: list[w.Ticket] = await self._run(make)
        return result

    async def finish(
        self, ticket: w.Ticket, outcome: str, now_ms: int, delay_ms: int = 0, fault: w.Fault = None
    ) -> str | bool:
        make = partial(w.plan_finish, ticket, outcome, now_ms, delay_ms, limits=self.limits)
        result: str | bool = await self._run(make, check_async_fault(fault))
        return result

    async def finish_many(self, results: list[tuple[w.Ticket, str, int, int]]) -> list[str | bool]:
        make = partial(w.plan_finish_many, results, limits=self.limits)
        statuses: list[str | bool] = await self._run(make)
        return statuses

    async def extend(
        self, ticket: w.Ticket, now_ms: int, lease_ms: int, fault: w.Fault = None
    ) -> w.Ticket | bool:
        make = partial(w.plan_extend, ticket, now_ms, lease_ms, limits=self.limits)
        result: w.Ticket | bool = await self._run(make, check_async_fault(fault))
        return result

    async def extend_many(
        self, tickets: list[w.Ticket], now_ms: int, lease_ms: int
    ) -> list[w.Ticket | bool]:
        extended: list[w.Ticket | bool] = await self._run(
            partial(w.plan_extend_many, tickets, now_ms, lease_ms, limits=self.limits)
        )
        return extended

    async def cycle(
        self,
        results: Sequence[tuple[w.Ticket, str, int, int]],
        held: Sequence[w.Ticket],
        owner: str,
        now_ms: int,
        lease_ms: int,
        count: int,
        fresh: int = 0,
    ) -> w.Cycle:
        make = partial(
            w.plan_cycle,
            results,
            held,
            owner,
            now_ms,
            lease_ms,
            count,
            fresh,
            limits=self.limits,
        )
        outcome: w.Cycle = await self._run(make)
        return outcome

    async def limit_rate(self, rate: r.Rate) -> None:
        """Make ``rate`` the queue's shared send rate (its table, when absent, too)."""
        await self._run(partial(r.plan_rate_setup, rate))

    async def shared_rate(self) -> r.Rate | None:
        """The queue's shared send rate, if one was set (``limit_rate``): read outside any
        write transaction, so a run looking for it every second takes no write lock."""
        plan, reply = r.plan_shared_rate(), None
        while True:  # (the plan's steps are reads only)
            try:
                step = plan.send(reply)
            except StopIteration as stop:
                rate: r.Rate | None = stop.value[0]
                return rate
            assert isinstance(step, w.Sql)
            reply = await self.read(step.sql, step.params)

    async def clear_rate(self) -> bool:
        """Remove the queue's shared send rate (every worker's claims go unpaced, also
        those of runs paced so far); whether there was one."""
        cleared: bool = await self._run(r.plan_rate_clear)
        return cleared

    async def paced_cycle(
        self,
        rate: r.Rate,
        results: Sequence[tuple[w.Ticket, str, int, int]],
        held: Sequence[w.Ticket],
        *claim: Any,
        again: int = 0,
        lead_us: int = 0,
    ) -> r.Paced:
        """``cycle`` whose claims (``owner, now_ms, lease_ms, count, fresh``) take permits of
        the shared ``rate`` in its transaction (``core.rate.plan_paced_cycle``)."""
        make = partial(r.plan_paced_cycle, rate, results, held, *claim, again=again)
        make = partial(make, lead_us=lead_us, limits=self.limits)
        outcome: r.Paced = await self._run(make)
        return outcome

    async def redrive(
        self,
        job_id: str,
        now_ms: int | None = None,
        ttl_ms: int | None = None,
        note: str | None = None,
        fault: w.Fault = None,
    ) -> bool:
        """Give a dead job a new life (``note``, required, says why); None: the queue's clock
        and ttl."""
        ttl = self.budget.ttl_ms if ttl_ms is None else ttl_ms
        make = partial(w.plan_redrive, job_id, self._now(now_ms), ttl, note, limits=self.limits)
        return bool(await self._run(make, check_async_fault(fault)))

    async def run_once(
        self,
        owner: str,
        clock: Callable[[], int],
        send: Callable[[dict[str, Any]], Awaitable[object]],
        jitter: float,
        lease_ms: int = 1000,
    ) -> dict[str, Any] | None:
        """The core's ``run_once`` with an async ``send``, awaited outside any transaction."""
        w.check_run_args(owner, clock, send, jitter, lease_ms, self.limits)
        first = w.check_now(clock(), "first clock reading", self.limits)
        ticket = await self.claim(owner, first, lease_ms)
        if ticket is None:
            return None
        mine = ticket.copy()
        outcome, delay = await classify(send, mine, jitter)
        now = w.second_reading(clock, first, self.limits)
        return w.delivery_result(mine, await self.finish(mine.copy(), outcome, now, delay))


def check_defaults(clock: object, ttl_ms: object, max_attempts: object, limits: w.Limits) -> Budget:
    """The defaults given at open: a ValueError names the argument and its range."""
    w.check_callable(clock, "clock")
    return Budget.of(ttl_ms, max_attempts, limits)


async def classify(
    send: AsyncSend, ticket: w.Ticket, jitter: float, *extra: Any
) -> tuple[str, int]:
    """The async twin of ``worker.classify``: the judgement itself is ``worker.judge_send``."""
    try:
        ack = await send(w.fresh_event(ticket), *extra)
    except (w.Retryable, w.Permanent) as error:
        return w.judge_send(ticket, jitter, error=error)
    return w.judge_send(ticket, jitter, ack)
