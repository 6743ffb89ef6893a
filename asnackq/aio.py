"""The asyncio layer: a queue driven through aiosqlite (or psycopg) and many concurrent delivery
coroutines that send through aiohttp outside any transaction.

Two classes, the layer's whole public face: ``AsyncQueue`` runs the core's plans off the
event loop; the ``Dispatcher`` runs ``concurrency`` delivery coroutines (``deliver``) over
one queue, with one committer (``asnackq.dispatch.committer``) doing every transaction.

Rules of this layer:

1. **No second state machine.** Every transition is a ``worker.plan_*`` plan (or
   ``core.rate``'s paced cycle), run whole in one transaction by a store's driver: on a
   file aiosqlite's (``asnackq.store.sqlite_aio``), on a ``postgresql://`` URL psycopg's
   (``asnackq.store.pg_session``); the same plans, the same results, the same hooks.
2. **One connection and one ``asyncio.Lock`` per queue**: two coroutines' transactions
   never interleave.  A transaction runs in its own task under ``asyncio.shield``: a
   cancelled caller waits for the COMMIT or ROLLBACK, then re-raises - never a split write.
   On a file, the intakes waiting for the lock when a transaction of the queue's own has
   run its statements ride it: their plans run then, before its COMMIT; one that comes
   during the COMMIT runs in its own or rides the next (``store.joint.Riders``).
3. **No transaction is open across a network await.**  Delivery coroutines never touch
   the queue: each takes a claimed ticket, sends it (``await send(event, token)``; aiohttp
   in ``asnackq.wire.send``), and hands back what it saw; the committer finishes it.
4. **The contract's two clock readings.**  The reading at the claim is a delivery's first;
   the coroutine takes the second when the send returns, exactly as ``run_once`` does,
   both from the run's ``RunClock`` (a wall clock stepped back holds the run's time).
5. **Leases are kept while a send lasts**; a ticket is sent only while the run holds its
   lease, and finished under the exact lease it was claimed with (the fence).  A lost
   ticket is never sent again and its result is dropped.
6. **The delivery path runs one way**: a coroutine gets its ticket, the send and a
   read-only view of its lease (``Port``), and returns a ``Sent`` (outcome, requests,
   re-sends, overloads, breaker samples); only the committer changes the run's state.
7. **On the application's connection** (``AsyncQueue.within``) a queue runs its intakes
   inside the application's open transaction (``asnackq.store.borrowed``) and refuses
   the rest.
8. Every task a run creates is awaited and its exception retrieved, on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import logging
import math
import os
import random
import re
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, NamedTuple, TypeVar

from asnackq.core import endpoint_workers as ew
from asnackq.core import endpoints as ep
from asnackq.core import events as ev
from asnackq.core import lanes, tracing
from asnackq.core import rate as r
from asnackq.core import worker as w
from asnackq.core.budget import DEFAULT_MAX_ATTEMPTS, Budget, Item, intakes
from asnackq.core.endpoints import Change, Endpoint, Schedule
from asnackq.dispatch import fleet as fl
from asnackq.dispatch.breaker import Breaker, BreakerPolicy
from asnackq.dispatch.committer import Committer
from asnackq.dispatch.endpoint import EndpointSend
from asnackq.dispatch.events import Event, Events, EventStream, Listener
from asnackq.dispatch.gate import Gate
from asnackq.dispatch.port import Port
from asnackq.dispatch.runclock import RunClock
from asnackq.dispatch.settings import Settings, SharedRate, Trace
from asnackq.dispatch.spans import DeliverySpans
from asnackq.dispatch.summary import Summary
from asnackq.dispatch.tickets import Claimed, Sent, made
from asnackq.store import attempts, job_traces
from asnackq.store.attempts import Record
from asnackq.store.intakes import Intakes
from asnackq.store.joint import ADOPTED, Gathering, Joint, Riders, Underway
from asnackq.store.opening import Store, open_store
from asnackq.store.outage import Health, StoreUnavailable
from asnackq.store.sqlite_aio import QueueBusy
from asnackq.store.targets import is_url, one_line
from asnackq.wire.send import LAST_ANSWER, AsyncSend, Gone, TimedOut, Untrusted

__all__ = [
    "NOT_AN_INTAKE",
    "AsyncQueue",
    "Clock",
    "Dispatcher",
    "Event",
    "Fleet",
    "QueueBusy",
    "QueueClosed",
    "Summary",
    "default_owner",
]

T = TypeVar("T")
Clock = Callable[[], int]
logger = logging.getLogger("asnackq.worker")
NOT_AN_INTAKE = (
    "on the application's connection a queue only enqueues: claims, finishes and the "
    "Dispatcher are the queue's own transactions (open it with AsyncQueue.connect)"
)


class _Closing:
    """Whether a queue's ``close()`` began - shared by the queue and its views (``in_lane``),
    which share its connection - and its transactions under way, which ``close()`` waits
    for: each was admitted before it began."""

    def __init__(self) -> None:
        self.begun = False
        self.running = Underway()


class QueueClosed(ValueError):
    """A call made to a queue once its ``close()`` began: refused, nothing done (the calls
    made before it are answered before the connection closes)."""

    def __init__(self) -> None:
        super().__init__("the queue is closed (its close() was called): nothing was done")


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
    attempts count only real refusals and timeouts (``asnackq.core.budget``).
    """

    def __init__(
        self,
        db: Store,
        limits: w.Limits = w.PRODUCT,
        intakes_only: bool = False,
        *,
        clock: Clock = w.epoch_ms,
        budget: Budget | None = None,
        max_event_bytes: int = ev.DEFAULT_MAX_BYTES,
    ) -> None:
        """A queue on an open ``Store``; ``connect``, ``open`` and ``within`` make one.
        ``budget``: as checked by ``check_defaults`` (None: the default ttl and attempts);
        ``max_event_bytes``: the largest body an event's intake stores (1 B..1 MiB)."""
        self.max_event_bytes = ev.check_max_bytes(max_event_bytes)
        if budget is None:
            budget = check_defaults(clock, None, DEFAULT_MAX_ATTEMPTS, limits)
        self.budget = budget
        self._db = db
        self._lock = asyncio.Lock()
        self.limits = limits
        self.clock = clock
        self.intakes_only = intakes_only  # on the application's connection: see ``within``
        self.tracer = tracing.tracer()  # None: intakes are not traced (``asnackq.core.tracing``)
        self.lane: lanes.Lane | None = None  # None: claims take any job (see ``in_lane``)
        self._event_tables = False  # made by an event's intake on this connection
        self._workers_table = False  # made by this connection's first ``note_endpoints``
        self._closing = _Closing()  # once ``close()`` began: every new call is refused
        # one transaction, many calls (admitted: the calls it carries came before close())
        self._intakes = Intakes(partial(self._run, intake=True, admitted=True))
        self._joint = Joint(partial(self._shielded, host=True))  # the lanes' (``in_lane``)
        self._riders: Riders | None = None  # a file's intakes, riding other transactions
        # called with the endpoints given deliveries by an intake of this queue, once
        # committed (a fleet on the same queue looks for them at once: ``Fleet.wake``)
        self.published: list[Callable[[set[str]], object]] = []

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
        max_event_bytes: int = ev.DEFAULT_MAX_BYTES,
    ) -> AsyncQueue:
        """Open a queue file (``open_queue``'s format and settings) or a ``postgresql://`` URL
        (``asnackq.store.pg``: the same tables in that database); close it with ``close()``.

        ``limits``: the ranges accepted (default ``PRODUCT``: ttl up to 30 days, leases and
        delays up to an hour; ``worker.CONTRACT`` gives the graded functions' ranges).
        ``clock``, ``ttl_ms``, ``max_attempts``: the time and budget of calls that name
        none (see the class), checked here against ``limits``.  ``max_event_bytes``: the
        largest body an event (``asnackq.core.events``) may store, 256 KiB unless given
        (at most 1 MiB).

        A locked file is waited on for ``busy_s`` per try (SQLite's busy timeout), and BEGIN
        is tried ``attempts`` times with a jittered backoff before ``QueueBusy`` is raised.
        """
        target = path if is_url(path) else w.check_queue_path(path)
        if not 0 < busy_s <= 60:
            raise ValueError(f"busy_s must be in (0, 60]: {busy_s!r}")
        w.check_int(attempts, "attempts", 1, 100)
        defaults = check_defaults(clock, ttl_ms, max_attempts, limits)  # before any change
        ev.check_max_bytes(max_event_bytes)
        store = await open_store(target, w.SCHEMA, busy_s, attempts)
        queue = cls(
            store, limits, False, clock=clock, budget=defaults, max_event_bytes=max_event_bytes
        )
        if is_url(target):  # intakes on a session of their own, beside the cycles
            queue._intakes.own(partial(open_store, target, w.SCHEMA, busy_s, attempts))
        else:  # intakes on the queue's connection, riding its transactions
            queue._riders = Riders(queue._shielded)
        return queue

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
        max_event_bytes: int = ev.DEFAULT_MAX_BYTES,
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
            max_event_bytes=max_event_bytes,
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
        max_event_bytes: int = ev.DEFAULT_MAX_BYTES,
    ) -> AsyncQueue:
        """A queue on a connection the application owns: an ``aiosqlite.Connection`` on the
        queue's file or a psycopg ``AsyncConnection`` (``asnackq.store.borrowed``).

        ``enqueue`` and ``enqueue_many`` run inside the application's open transaction and
        commit with it; claims, finishes and the Dispatcher are refused (they are the
        queue's own transactions: open the queue with ``connect`` for them).  The tables are
        created here, in a transaction of their own.  ``clock``, ``ttl_ms``,
        ``max_attempts``, ``max_event_bytes``: as ``connect``'s.
        """
        from asnackq.store import borrowed

        w.check_int(attempts, "attempts", 1, 100)
        defaults = check_defaults(clock, ttl_ms, max_attempts, limits)  # before any change
        ev.check_max_bytes(max_event_bytes)
        store = await borrowed.adopt(con, w.SCHEMA, attempts)
        return cls(
            store, limits, True, clock=clock, budget=defaults, max_event_bytes=max_event_bytes
        )

    async def close(self) -> None:
        """Answer the calls made so far, then close the queue's connection (on the
        application's connection: nothing).  A call made once ``close()`` began raises
        ``QueueClosed`` and does nothing, on every store (no session is opened again).  A
        view (``in_lane``) shares its queue's connection: closing either closes both.  A
        cancelled caller waits for the close to end, then re-raises (as a transaction's
        caller does): a queue is never left refusing calls with its sessions open."""
        self._closing.begun = True  # (at once: a call made from now on is refused)
        if await unshaken(self._close()):
            raise asyncio.CancelledError

    async def _close(self) -> None:
        closing = self._closing
        gatherings: list[Gathering[Any]] = [self._intakes, self._joint]
        gatherings += [self._riders] if self._riders is not None else []
        while closing.running or any(gathering.busy for gathering in gatherings):
            for gathering in gatherings:
                await gathering.drained()
            await closing.running.drained()
        await self._intakes.close()
        async with self._lock:
            await self._db.close()

    @property
    def closing(self) -> bool:
        """Whether ``close()`` began (on this queue or a view of it): calls are refused."""
        return self._closing.begun

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
        """The store's session and its outages: a ``postgresql://`` server away, a file held
        by another program (None on the application's connection)."""
        return getattr(self._db, "health", None)

    def _admit(self) -> None:
        """Refuse a call made once ``close()`` began (``QueueClosed``)."""
        if self._closing.begun:
            raise QueueClosed

    async def _run(
        self,
        make: Callable[[], w.Plan[T]],
        fault: w.Fault = None,
        intake: bool = False,
        admitted: bool = False,
    ) -> T:
        """Run one plan under the lock, shielded: cancellation never splits the transaction.

        ``make`` builds the plan, validating it before any I/O (a store may build it again
        to retry a transaction that met a concurrent one).  ``admitted``: the transaction
        of calls made before ``close()`` began (the intakes'), run even while it closes.
        """
        if not admitted:
            self._admit()
        if self.lane is not None:
            make = partial(lane_plan, make, self.lane)
        again = prebuilt(make)  # the first try runs the plan validated here
        if self.intakes_only and not intake:
            raise ValueError(NOT_AN_INTAKE)
        if intake and not fault and self._riders is not None:
            ridden: T = await self._riders.run(again)  # riding a transaction of the queue's
            return ridden
        if self.lane is not None and self.lane.endpoint is not None and not intake and not fault:
            joined: T = await self._joint.run(make)  # endpoints' lanes share transactions
            return joined
        return await self._shielded(again, fault, host=not intake and not fault)

    async def _shielded(
        self,
        make: Callable[[], w.Plan[T]],
        fault: w.Fault = None,
        host: bool = False,
        skip: Callable[[], bool] | None = None,
    ) -> T:
        """``make``'s plan in a transaction of its own, under the lock, shielded (``host``,
        without ``fault``: the intakes waiting for the lock when its plan ends ride it;
        ``skip``: no transaction if it says so once the lock is held, ``ADOPTED`` returned)."""

        async def locked() -> T:
            async with self._lock:
                if skip is not None and skip():
                    adopted: T = ADOPTED
                    return adopted
                if host and not fault and self._riders is not None:
                    return await self._hosting(make, self._riders)
                result: T = await self._db.run(make, fault)
                return result

        task = self._closing.running.add(asyncio.ensure_future(locked()))  # (``close()``'s)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])  # let COMMIT or ROLLBACK land, then re-raise
            raise

    async def _hosting(self, make: Callable[[], w.Plan[T]], riders: Riders) -> T:
        """``make``'s plan, then the plans of the intakes waiting for the lock as it ends, in
        one transaction (under the lock); each rider gets its own fate."""
        taken: list[Any] = []

        def plan() -> w.Plan[tuple[T, list[Any]]]:
            result, changed = yield from make()
            if not taken:  # (a plan made again runs the same riders)
                taken.extend(riders.adopt())
            found = []
            for call in taken:
                one, wrote = yield from call.make()
                found.append(one)
                changed = changed or wrote
            return (result, found), changed

        try:
            hosted: tuple[T, list[Any]] = await self._db.run(plan)
        except StoreUnavailable as error:
            for call in taken:
                call.settle(error)
            raise
        except Exception:
            if not taken:
                raise
            for call in taken:  # each alone, then the host: each its own fate
                try:
                    call.settle(await self._db.run(call.make))
                except Exception as error:
                    call.settle(error)
            again: T = await self._db.run(make)
            return again
        else:
            result, found = hosted
            for call, one in zip(taken, found, strict=True):
                call.settle(one)
            return result
        finally:
            for call in taken:  # cancelled before its fate was known: never an endless wait
                if not call.future.done():
                    call.future.cancel()

    async def read(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> list[tuple[Any, ...]]:
        """A read-only query outside any write transaction."""
        self._admit()
        async with self._lock:  # (taken at once, or queued before ``close()``'s turn)
            return await self._read_locked(sql, params)

    async def _read_locked(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any]
    ) -> list[tuple[Any, ...]]:
        if self.lane is not None:
            sql, params = lanes.text(self.lane, sql, params)
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
        *,
        to: Sequence[str] | None = None,
    ) -> bool:
        """Enqueue ``event`` (True inserted, False already there); None: the queue's clock
        and budget.  An event with ``data`` is fanned out to the queue's endpoints
        (``publish``; ``to``: to those named)."""
        self._admit()
        if ev.is_event(event):
            return (await self.publish(event, now_ms, ttl_ms, max_attempts, to=to)).created
        if to is not None:
            raise ValueError("to names endpoints for an event with data, not for {id, qty}")
        ttl, tries = self.budget.fill(ttl_ms, max_attempts)
        now = self._now(now_ms)
        if self.tracer is not None or self.intakes_only:
            make = partial(w.plan_enqueue, event, now, ttl, tries, limits=self.limits)
            if self.tracer is not None:
                return bool((await self._traced(make, [(event, ttl, tries)]))[0])
            return bool(await self._run(make, intake=True))  # (the application's transaction)
        # validated here, once: a bad event is this caller's ValueError alone
        checked = w.check_enqueue(event, now, ttl, tries, self.limits)
        return await self._intakes.enqueue(checked, now_ms is not None)

    async def enqueue_many(
        self, items: Sequence[Item], now_ms: int | None = None, *, to: Sequence[str] | None = None
    ) -> list[bool | w.Conflict]:
        """Enqueue plain events (the queue's budget) or ``(event, ttl_ms, max_attempts)``
        triples, mixed as needed, in one transaction; events with ``data`` among them are
        fanned out (``publish``), each a True or False here."""
        self._admit()
        triples = intakes(items, self.budget)
        if to is not None or any(ev.is_event(event) for event, _, _ in triples):
            found = await self._publish(triples, now_ms, to)
            return [r.created if isinstance(r, ev.Published) else r for r in found]
        make = partial(w.plan_enqueue_many, triples, self._now(now_ms), limits=self.limits)
        if self.tracer is not None:
            return await self._traced(make, triples)
        if self.intakes_only:  # in the application's transaction: that is the one
            results: list[bool | w.Conflict] = await self._run(make, intake=True)
            return results
        results = await self._intakes.run(prebuilt(make))  # validated here, before any I/O
        return results

    async def publish(
        self,
        event: dict[str, Any],
        now_ms: int | None = None,
        ttl_ms: int | None = None,
        max_attempts: int | None = None,
        *,
        to: Sequence[str] | None = None,
    ) -> ev.Published:
        """Store an event ``{"id", "data", "type"?, "key"?}`` with one delivery (a job) per
        enabled endpoint taking its type, or per endpoint ``to`` names, in one transaction
        (``asnackq.core.events``): what was created.  The same event again: ``created``
        False, no delivery; the same id with another type, key or data: ``Conflict``."""
        if not ev.is_event(event):
            raise ValueError("publish takes an event with data: {id, data, type?, key?}")
        ttl, tries = self.budget.fill(ttl_ms, max_attempts)
        (found,) = await self._publish([(event, ttl, tries)], now_ms, to)
        if isinstance(found, w.Conflict):
            raise found
        assert isinstance(found, ev.Published)
        return found

    async def _publish(
        self, triples: list[tuple[object, object, object]], now_ms: int | None, to: object
    ) -> list[ev.Published | bool | w.Conflict]:
        tables = not self._event_tables or self.intakes_only  # (an application may roll back)
        make = partial(
            ev.plan_intake,
            triples,
            self._now(now_ms),
            to=to,
            max_bytes=self.max_event_bytes,
            limits=self.limits,
            tables=tables,
        )
        found: list[ev.Published | bool | w.Conflict] = await self._run(make, intake=True)
        self._event_tables = True
        if self.published and not self.intakes_only:  # (committed: a fleet may look now)
            names = {name for r in found if isinstance(r, ev.Published) for name, _ in r.deliveries}
            for listener in list(self.published):
                listener(names)
        return found

    def in_lane(self, lane: lanes.Lane) -> AsyncQueue:
        """This queue (its connection, lock and budget) with claims in ``lane``: one
        endpoint's deliveries only, or (``lanes.PLAIN``) only jobs that are not deliveries
        (``asnackq.core.lanes``); a Dispatcher on it claims and waits for those alone."""
        if type(lane) is not lanes.Lane or type(lane.ordered) is not bool:
            raise ValueError(f"lane must be a lanes.Lane: {lane!r}")
        if lane.ordered and lane.endpoint is None:
            raise ValueError("an ordered lane is an endpoint's: lanes.Lane(name, ordered=True)")
        view = copy.copy(self)
        view.lane = lane
        return view

    async def prepare_lane(self) -> None:
        """Create the tables a lane's claims read, if absent (a plain lane: the deliveries'
        table alone, so that a queue without events keeps the core's indexes only)."""
        if self.lane is not None and self.lane.endpoint is None:
            await self._run(partial(w.plan_schema, (lanes.DELIVERIES,)))
        elif self.lane is not None:
            await self._run(partial(w.plan_schema, (*ep.SCHEMA, *ev.SCHEMA)))

    async def delivery(self, job_id: str) -> tuple[str, bytes] | None:
        """A delivery's event id and stored body (None: the job is no delivery)."""
        rows = await self.read(ev.SQL_BODY, (w.check_identifier(job_id, "job id"),))
        return None if not rows else (rows[0][0], bytes(rows[0][1]))

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
        *,
        attempts: Sequence[Record] = (),
        own: bool = False,
    ) -> w.Cycle:
        """One transaction of a Dispatcher (``core.worker.plan_cycle``), with the answers
        of its requests kept (``attempts``: ``asnackq.store.attempts``).  ``own``: the
        tickets are the run's own, as this queue's plans issued them and no other code
        has held them since (``core.worker.plan_cycle``'s ``own``: not checked again)."""
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
            own=own,
        )
        outcome: w.Cycle = await self._run(with_records(make, attempts))
        return outcome

    async def keep_attempts(self) -> None:
        """Create the table of the requests' answers, if absent (``asnackq.store.attempts``)."""
        await self._run(attempts.plan_create)

    async def limit_rate(self, rate: r.Rate) -> None:
        """Make ``rate`` the queue's shared send rate (its table, when absent, too)."""
        await self._run(partial(r.plan_rate_setup, rate))

    @property
    def rate_key(self) -> str:
        """The key of the shared send rate this queue's runs keep to: the queue's, or in an
        endpoint's lane (``in_lane``) that endpoint's own."""
        if self.lane is None or self.lane.endpoint is None:
            return r.DEFAULT_KEY
        return "endpoint_" + lanes.lane_of(self.lane.endpoint)

    async def shared_rate(self) -> r.Rate | None:
        """The shared send rate (``rate_key``'s), if one was set (``limit_rate``): read
        outside any write transaction, so a run looking for it every second takes no write
        lock."""
        rate: r.Rate | None = await self._read(r.plan_shared_rate(self.rate_key))
        return rate

    async def _read(self, plan: w.Plan[T]) -> T:
        """A read plan's result, its statements read outside any write transaction, one
        after the other under the lock (``close()`` never comes between them)."""
        self._admit()
        reply: w.Reply = None
        async with self._lock:
            while True:
                try:
                    step = plan.send(reply)
                except StopIteration as stop:
                    result: T = stop.value[0]
                    return result
                if not isinstance(step, w.Sql):
                    raise TypeError(f"a read plan yields statements only: {step!r}")
                reply = await self._read_locked(step.sql, step.params)

    async def clear_rate(self) -> bool:
        """Remove the queue's shared send rate (every worker's claims go unpaced, also
        those of runs paced so far); whether there was one."""
        cleared: bool = await self._run(partial(r.plan_rate_clear, self.rate_key))
        return cleared

    async def paced_cycle(
        self,
        rate: r.Rate,
        results: Sequence[tuple[w.Ticket, str, int, int]],
        held: Sequence[w.Ticket],
        owner: str,
        now_ms: int,
        lease_ms: int,
        count: int,
        fresh: int = 0,
        *,
        again: int = 0,
        lead_us: int = 0,
        attempts: Sequence[Record] = (),
        own: bool = False,
    ) -> r.Paced:
        """``cycle`` whose claims take permits of the shared ``rate`` in its transaction
        (``core.rate.plan_paced_cycle``)."""
        claim = (owner, now_ms, lease_ms, count, fresh)
        make = partial(r.plan_paced_cycle, rate, results, held, *claim, again=again)
        make = partial(make, lead_us=lead_us, limits=self.limits, own=own)
        outcome: r.Paced = await self._run(with_records(make, attempts))
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

    # A queue's endpoints (``asnackq.core.endpoints``): each change one transaction with its
    # audit row; None for ``now_ms``: the queue's clock.

    async def add_endpoint(
        self, endpoint: Endpoint, *, allow_remote: bool = False, now_ms: int | None = None
    ) -> Endpoint:
        """Add ``endpoint`` (as stored: its times set); ``EndpointExists`` if the name is
        taken.  A host that is not loopback only with ``allow_remote``."""
        now = self._now(now_ms)
        stored: Endpoint = await self._run(
            partial(ep.plan_add, endpoint, now, allow_remote=allow_remote)
        )
        return stored

    async def endpoint(self, name: str) -> Endpoint:
        """The endpoint ``name`` (``NoSuchEndpoint`` if the queue has none)."""
        return await self._read(ep.plan_get(name))

    async def endpoints(self) -> list[Endpoint]:
        """Every endpoint of the queue, by name."""
        return await self._read(ep.plan_list())

    async def endpoint_changes(self, name: str | None = None, limit: int = 20) -> list[Change]:
        """The last ``limit`` audited changes, newest first: of ``name``, or of all."""
        return await self._read(ep.plan_changes(name, limit))

    async def update_endpoint(
        self, name: str, /, *, allow_remote: bool = False, now_ms: int | None = None, **changes: Any
    ) -> Endpoint:
        """Change fields of an endpoint (``url``, ``types``, ``secrets``, ``rate``, ``burst``,
        ``concurrency``, ``timeout_s``, ``retry``, ``success``, ``ordered``, ``headers``);
        the endpoint now.  Changing nothing writes nothing."""
        make = partial(ep.plan_update, name, changes, self._now(now_ms), allow_remote=allow_remote)
        updated: Endpoint = await self._run(make)
        return updated

    async def rotate_secret(
        self, name: str, secret: str, overlap_s: float = 86_400, *, now_ms: int | None = None
    ) -> Endpoint:
        """Sign with ``secret`` from now; the secrets it replaces keep signing beside it
        for ``overlap_s`` (0..30 days)."""
        make = partial(ep.plan_rotate, name, secret, self._now(now_ms), overlap_s)
        rotated: Endpoint = await self._run(make)
        return rotated

    async def disable_endpoint(self, name: str, reason: str, *, now_ms: int | None = None) -> bool:
        """Disable an endpoint for ``reason`` (a worker that met ``410 Gone``: "gone: answered
        410"); False if it already was (its reason and time kept)."""
        done: bool = await self._run(partial(ep.plan_disable, name, reason, self._now(now_ms)))
        return done

    async def enable_endpoint(self, name: str, *, now_ms: int | None = None) -> bool:
        """Enable an endpoint; False if it already was."""
        done: bool = await self._run(partial(ep.plan_enable, name, self._now(now_ms)))
        return done

    async def remove_endpoint(self, name: str, *, now_ms: int | None = None) -> Endpoint:
        """Remove an endpoint (its audited changes stay); the endpoint removed."""
        removed: Endpoint = await self._run(partial(ep.plan_remove, name, self._now(now_ms)))
        return removed

    async def note_endpoints(
        self,
        owner: str,
        rows: Sequence[ew.Seen | tuple[str, bool, int, int]],
        now_ms: int | None = None,
    ) -> int:
        """Say, as ``owner``, what it sees of the endpoints it serves: ``(endpoint,
        breaker_open, limit, in_flight)`` rows, its whole report (its rows of other endpoints
        go), in one short transaction (``asnackq.core.endpoint_workers``); the rows noted.
        ``asnackq stats`` and the dashboard show rows noted within the last 15 s."""
        make = partial(ew.plan_note, owner, rows, self._now(now_ms), tables=not self._workers_table)
        noted: int = await self._run(make)
        self._workers_table = True
        return noted

    async def run_once(
        self,
        owner: str,
        clock: Callable[[], int],
        send: AsyncSend,
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


def prebuilt(make: Callable[[], w.Plan[T]]) -> Callable[[], w.Plan[T]]:
    """``make``'s plan built (validated) now, then ``make`` again for each try after the first
    (a store builds it again to retry a transaction): a plan is validated once per try."""
    built = [make()]

    def again() -> w.Plan[T]:
        return built.pop() if built else make()

    return again


def lane_plan(make: Callable[[], w.Plan[T]], lane: lanes.Lane) -> w.Plan[T]:
    """``make``'s plan with its claims in ``lane`` (``asnackq.core.lanes``)."""
    return lanes.substituted(make(), lane)


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


DEFAULT_BREAKER = BreakerPolicy()
FLOOR_WAIT_MAX_S = 1.0  # a latency floor above this is no pace for a sink that asked none


async def deliver(port: Port, send: AsyncSend) -> None:
    """One delivery coroutine: take a ticket, wait for its slot of a shared rate, send it,
    hand the result back; until None.  With a gate (concurrency "auto"), a slot of the gate
    is held from the take to the hand-back."""
    spans, shared = port.settings.spans, port.settings.shared  # (the run's rate: ``rate``)
    while True:
        if port.gate is not None:
            await port.gate.acquire()
        try:
            if (claimed := await port.take()) is None:
                return
            paced = shared.rate is not None  # (``slot`` is True at once without)
            if paced and not await port.slot(claimed):  # a shared rate's slot: lost meanwhile
                port.hand_back(Sent(claimed, None))
                continue
            attached = None if spans is None else spans.begin(claimed)
            try:
                sent = await send_until_answered(port, send, claimed)
            except Exception:  # a bad clock or jitter: the run fails, the job stays leased
                port.hand_back(Sent(claimed, None, failure="errors", fatal=True))
                raise
            finally:
                if spans is not None:
                    spans.detach(attached)
        finally:
            if port.gate is not None:
                port.gate.release()
        if spans is not None:
            spans.sent(sent)
        port.hand_back(sent)


async def send_until_answered(port: Port, send: AsyncSend, claimed: Claimed) -> Sent:
    """Send a ticket, and again under the same lease while the sink is not there.

    Classified like ``run_once``; an ``Unavailable`` failure is not an outcome: the send
    goes again (paced by the retry policy, gated by the breaker) for as long as the run
    keeps the lease - up to the job's deadline.  Nor is an ``Overloaded`` answer: the send
    goes again under the same lease once the wait the sink asked for is over (see
    ``wait_overload``).  Under a shared rate every send takes a slot: a re-send a new one.
    Each pass of the loop is reported (``Port.report``: ``tickets.Report``).
    """
    ticket, settings, again = claimed.ticket, port.settings, 0
    while True:
        breaker = port.breaker
        probe = await breaker.admit(port.lease_left_s(ticket)) if breaker.is_open else False
        if (again or probe is not False) and not port.keeps(ticket):
            port.report(probe, None)  # (a first send's ticket was just checked)
            return Sent(claimed, None)  # lost, or at its deadline: no answer
        if probe is None:
            continue  # the lease was extended meanwhile
        if again and not await port.slot(claimed, again=True):  # a shared rate's new slot
            port.report(probe, None)
            return Sent(claimed, None)  # lost while it waited
        jitter = settings.jitter()
        if type(jitter) is not float or not 0 <= jitter <= 1:  # (``w.check_jitter``'s range)
            jitter = w.check_jitter(jitter)
        at_ms = port.now()
        if LAST_ANSWER.get() is not None:  # (a sender of the application's own may tell
            LAST_ANSWER.set(None)  # nothing; a set costs more than a get)
        try:  # one request for the ticket
            event, token, gate = w.fresh_event(ticket), ticket["token"], port.gate
            ack = await (send(event, token) if gate is None else gate.send(send, event, token))
            outcome = OK if ack is True else judged(settings, ticket, jitter, ack)
        except Exception as error:
            seen, result = failed(port, claimed, jitter, error)
        else:  # (a bad clock: raised)
            seen = SEEN_OK if outcome is OK else Seen(False, verdict=outcome[0])
            result = finished(port, claimed, outcome)
        overloaded = seen.overloaded is not None
        record = kept(port, claimed, seen, at_ms, again)
        unavailable, cause, why = seen.unavailable, seen.cause, seen.why
        port.report(probe, unavailable, True, again > 0, overloaded, cause, why, record)
        again += 1
        if result is not None:
            return result
        if seen.overloaded:
            if not await wait_overload(port, claimed, seen.overloaded, again, jitter):
                return Sent(claimed, None)  # the lease ended meanwhile: no answer
        elif not port.breaker.is_open:  # the sink is away: after the retry policy's delay
            delay_ms = settings.retry.delay(min(again, 16), jitter, settings.limits)
            await asyncio.sleep(delay_ms / 1000)


class Seen(NamedTuple):
    """What one request showed of the sink: no sink (``unavailable``: True), an answer
    (False), neither (None: the send failed on our side); the overload it answered with;
    why there was no sink (``cause``: ``away``, ``timing_out`` - no answer in time -, or
    ``tls`` - it could not be trusted, ``why`` says how)."""

    unavailable: bool | None
    overloaded: w.Overloaded | None = None
    cause: str = "away"
    why: str = ""
    verdict: str = "error"  # what the request came to (``asnackq.store.attempts``)
    error: str = ""  # why no answer proved anything, in one line (kept when none came)


OK = ("ok", 0)  # an ACK's outcome and delay (``w.judge_send``)
SEEN_OK = Seen(False, verdict="ok")  # what an ACK showed of the sink


def judged(
    settings: Settings,
    ticket: w.Ticket,
    jitter: float,
    ack: object,
    error: w.Retryable | w.Permanent | None = None,
) -> tuple[str, int]:
    """The outcome and delay of an answer other than an ACK, or of a rejection ``error``
    (``w.judge_send``'s, then the run's schedule)."""
    outcome = w.judge_send(ticket, jitter, ack, error, settings.retry, settings.limits)
    return settings.retry_delay(ticket, outcome, jitter)


def failed(
    port: Port, claimed: Claimed, jitter: float, error: Exception
) -> tuple[Seen, Sent | None]:
    """What a request that raised ``error`` showed of the sink, and the ticket's result
    (None: no outcome, the ticket is sent again under its lease)."""
    if isinstance(error, w.Overloaded):
        return Seen(False, error, verdict="overloaded"), None  # the sink is there
    if isinstance(error, Untrusted):  # this worker's TLS set-up, or the sink's: not the job's
        return Seen(True, cause="tls", why=error.why, verdict="tls", error=error.why), None
    if isinstance(error, w.Unavailable):
        cause = "timing_out" if isinstance(error, TimedOut) else "away"
        verdict = "gone" if isinstance(error, Gone) else cause
        return Seen(True, cause=cause, verdict=verdict, error=one_line(error)), None
    if isinstance(error, (w.Retryable, w.Permanent)):
        outcome = judged(port.settings, claimed.ticket, jitter, None, error)
        seen = Seen(False, verdict=outcome[0], error=one_line(error))
        return seen, finished(port, claimed, outcome)
    bad = isinstance(error, w.BadAck)  # stays leased; reclaimed after the lease
    seen = Seen(False if bad else None, verdict="bad_ack" if bad else "error")
    return seen._replace(error=one_line(error)), Sent(
        claimed, None, failure="bad_acks" if bad else "errors"
    )


def with_records(make: Callable[[], w.Plan[T]], rows: Sequence[Record]) -> Callable[[], w.Plan[T]]:
    """``make``'s plan, writing ``rows`` in its transaction (none: the plan itself)."""
    if not rows:
        return make
    return lambda: attempts.recorded(make(), rows)


def kept(port: Port, claimed: Claimed, seen: Seen, at_ms: int, again: int) -> Record | None:
    """The record of a request, if the run keeps them and the claim has not kept its
    ``PER_CLAIM`` yet (``asnackq.store.attempts``)."""
    if not port.settings.keep_attempts or again >= attempts.PER_CLAIM:
        return None
    answer = LAST_ANSWER.get()
    status, latency_ms, body = (None, 0, b"") if answer is None else answer
    if status is None:  # no answer came (refused, reset, timed out, unreadable): why not
        body = seen.error.encode()
    ticket = claimed.ticket
    return made(
        Record,
        (
            ticket["id"],
            ticket["token"],
            ticket["attempt"],
            at_ms,
            status,
            latency_ms,
            seen.verdict,
            attempts.excerpt(body) if body else "",
        ),
    )


async def wait_overload(
    port: Port, claimed: Claimed, error: w.Overloaded, again: int, jitter: float
) -> bool:
    """Wait out an overload under the ticket's lease; False if the lease ended first.

    The wait is what the sink asked for.  A sink that asked for none (no ``Retry-After``,
    or ``0``: a slot frees within a second) is sent again after the retry policy's delay;
    under concurrency "auto", after about one latency floor (the sink's quickest answer so
    far, times 0.5 to 1.5, doubled for each overload of the same ticket, at most the retry
    policy's cap), and then through the gate, whose limit the overload has just cut.  The
    coroutine keeps its place meanwhile: under "auto" a sink refusing every request meets
    no more tickets than the gate's bound.
    """
    settings, gate = port.settings, port.gate
    wait_s = error.retry_after_s
    if wait_s:
        return await port.hold(claimed.ticket, wait_s)
    if gate is not None and gate.rule.floor_s < FLOOR_WAIT_MAX_S:
        backoff = gate.rule.floor_s * (0.5 + jitter) * 2 ** min(again - 1, 16)
        return await port.hold(claimed.ticket, min(backoff, settings.retry.cap_ms / 1000))
    delay_ms = settings.retry.delay(min(again, 16), jitter, settings.limits)
    return await port.hold(claimed.ticket, delay_ms / 1000)


def finished(port: Port, claimed: Claimed, outcome: tuple[str, int]) -> Sent:
    """The ticket's result: its outcome and delay, with the delivery's second clock reading."""
    now = port.now()  # (checked as ``w.second_reading`` checks it)
    if now < claimed.first:  # (never: the run's clock does not step back)
        raise ValueError(f"clock went backwards: {now} < {claimed.first}")
    return made(Sent, (claimed, outcome[0], now, outcome[1], None, False))


class Dispatcher:
    """Many delivery coroutines over one AsyncQueue, each job following ``run_once``'s contract.

    One committer task runs every transaction (see ``Committer``); ``concurrency``
    coroutines only send.  ``concurrency="auto"``: ``max_concurrency`` coroutines, of which
    as many send at once as an adaptive limit lets (``asnackq.dispatch.adaptive``).
    ``prefetch`` fixes how many tickets are kept claimed ahead of demand (default:
    adaptive).  ``gather_ms`` (at most a tenth of the lease is used) is
    how long results may wait for more while every coroutine is busy; 0 settles each
    batch as soon as the last transaction ends.  ``retry`` is the delay before a job's next
    attempt (and between re-sends while the sink is away); ``schedule`` (an endpoint's:
    ``endpoints.schedule_of``), if given, the delay before a job's next attempt instead;
    ``breaker`` when to pause for an outage.  ``clock`` is the queue's unless given.
    ``rate`` (sends a second, with bursts of at most ``burst``) caps the sends of every
    worker of the queue together (in an endpoint's lane: of that endpoint): its permits
    are taken with the claims (``asnackq.core.rate``), each ticket sent no earlier than its
    slot; it becomes the queue's rate (``AsyncQueue.rate_key``), which a run given none
    keeps to as well, looking for it at its start and every ``RATE_CHECK_S``
    (``settings.rate``: the run's now; ``AsyncQueue.clear_rate`` removes it).
    ``keep_attempts``: each request's status, latency, verdict and first KiB of its answer
    are written with the cycle that follows it (``asnackq.store.attempts``; shown by
    ``asnackq inspect``).
    Ranges are the queue's ``limits``.  ``summary`` is the current (or last) run's.
    """

    def __init__(
        self,
        queue: AsyncQueue,
        send: AsyncSend,
        *,
        owner: str | None = None,
        concurrency: int | Literal["auto"] = 64,
        max_concurrency: int = 256,
        lease_ms: int = 5000,
        clock: Callable[[], int] | None = None,
        jitter: Callable[[], float] = random.random,
        grace_s: float = 5.0,
        idle_ms: int = 20,
        gather_ms: int = 10,
        trace: Trace | None = None,
        prefetch: int | None = None,
        retry: w.Retry = w.RUN_ONCE_RETRY,
        schedule: w.Retry | Schedule | None = None,
        breaker: BreakerPolicy = DEFAULT_BREAKER,
        rate: float | None = None,
        burst: int = 1,
        on_event: Listener | None = None,
        keep_attempts: bool = True,
    ) -> None:
        limits = queue.limits
        if queue.intakes_only:
            raise ValueError(NOT_AN_INTAKE)
        if clock is None:
            clock = queue.clock
        if owner is None:
            owner = default_owner()
        w.check_run_args(owner, clock, send, 0.5, lease_ms, limits)
        check_send(send)
        w.check_int(max_concurrency, "max_concurrency", 1, 1024)
        self.adaptive = concurrency == "auto"
        if not self.adaptive:
            w.check_int(concurrency, "concurrency", 1, 1024)
        w.check_int(idle_ms, "idle_ms", 1, 60_000)
        w.check_int(gather_ms, "gather_ms", 0, 1000)
        if type(grace_s) not in (int, float) or not 0 <= grace_s <= 3600:
            raise ValueError(f"grace_s must be a number of seconds in 0..3600: {grace_s!r}")
        retry.check(limits)
        if schedule is not None and type(schedule) not in (w.Retry, Schedule):
            raise ValueError(f"schedule must be a Retry or a Schedule: {schedule!r}")
        if schedule is not None:
            schedule.check(limits)
        breaker.check()
        shared = None if rate is None else r.check_rate(rate, burst, queue.rate_key)
        if prefetch is not None:
            w.check_int(prefetch, "prefetch", 0, 1024)
        if on_event is not None and not callable(on_event):
            raise ValueError(f"on_event must be callable: {on_event!r}")
        self.queue, self.send, self.grace_s, self.breaker = queue, send, grace_s, breaker
        self.rate = shared  # None: the queue's, if it has one, at each run's start
        self._events = Events(owner)
        if on_event is not None:
            self._events.listeners.append(on_event)
        self.settings = Settings(
            owner=owner,
            concurrency=max_concurrency if concurrency == "auto" else concurrency,
            lease_ms=lease_ms,
            clock=clock,
            jitter=jitter,
            idle_ms=idle_ms,
            gather_ms=gather_ms,
            prefetch=prefetch,
            trace=trace,
            retry=retry,
            schedule=schedule,
            limits=limits,
            shared=SharedRate(shared, own=shared is not None),
            spans=DeliverySpans.of(owner),
            events=self._events,
            keep_attempts=bool(keep_attempts),
        )
        self.summary = Summary()
        self._breaker: Breaker | None = None
        self._committer: Committer | None = None
        self._clock: RunClock | None = None
        self._gate: Gate | None = None
        self._stop: asyncio.Event | None = None
        self._hurried = False  # ``hurry``: a stop's grace ends at once
        self._winding: Sequence[asyncio.Future[None]] = ()  # sends a stop waits for

    def events(self) -> EventStream:
        """``async for event in dispatcher.events()``: the run's events from now on (see
        ``asnackq.dispatch.events``), ending after the run's ``stopped``.  Start it before
        ``run`` to see the run's ``started``; the same events are log records of the
        ``asnackq.worker`` logger and go to ``on_event``."""
        return EventStream(self._events)

    def stop(self) -> None:
        """Stop the current run as a cancellation does (claim nothing more; sends in flight
        get ``grace_s``; results committed), after which ``run`` returns its summary."""
        if self._stop is not None:
            self._stop.set()

    def wake(self) -> None:
        """Look for claimable jobs now rather than at the next idle poll (some were just
        enqueued); nothing if no run is under way."""
        if self._committer is not None:
            self._committer.wake()

    @property
    def owner(self) -> str:
        """The name the run's leases are claimed under."""
        return self.settings.owner

    @property
    def paused(self) -> bool:
        """Whether the current run is paused by its circuit breaker (the sink is away)."""
        return self._breaker is not None and self._breaker.is_open

    @property
    def db_down(self) -> bool:
        """Whether the queue's database is away right now (its store is reconnecting)."""
        return self.queue.health is not None and self.queue.health.down

    def snapshot(self) -> dict[str, int]:
        """The current (or last) run's counts so far; the circuit breaker's and the clock's
        are live too (``summary`` gets them when the run ends)."""
        counts = self.summary.as_dict()
        if self._committer is not None:
            counts.update(self._committer.db_counts())
        if self._breaker is not None:
            live = self._breaker.counts
            counts.update(
                outages=live.outages, probes=live.probes, paused_ms=self._breaker.paused_ms_so_far()
            )
        if self._clock is not None:
            counts.update(clock_steps=self._clock.steps, clock_step_ms=self._clock.largest_ms)
        if self._gate is not None:
            counts.update(concurrency=self._gate.limit, concurrency_cuts=self._gate.cuts)
        return counts

    async def run(
        self, *, until_empty: bool = True, max_jobs: int | None = None, follow: bool = False
    ) -> Summary:
        """Deliver until the queue holds no pending or leased job (or ``max_jobs`` claims).

        ``until_empty=False``: stop as soon as nothing is claimable.  ``follow=True``: never
        stop on an empty queue; poll until cancelled (or ``max_jobs`` claims).  On
        cancellation: claim nothing more, let sends in flight (and tickets held) finish
        within ``grace_s``, commit their results, and re-raise.
        """
        if max_jobs is not None:
            w.check_int(max_jobs, "max_jobs", 0, 10**12)
        queue = self.queue
        if self.settings.keep_attempts:
            await outlasting(queue.keep_attempts)
        if queue.lane is not None:  # the tables its claims read
            await outlasting(queue.prepare_lane)
        if self.rate is not None:  # the queue's row: this rate for every worker
            await outlasting(partial(queue.limit_rate, self.rate))
        else:  # the queue's, if it has one (looked for again as the run goes on)
            self.settings.shared.rate = await outlasting(queue.shared_rate)
        self._gate = Gate(self.settings.concurrency) if self.adaptive else None
        committer = Committer(queue, self.settings, max_jobs, self.breaker, self._gate)
        if self.settings.rate is not None:
            clock = asyncio.get_running_loop().time
            await outlasting(partial(committer.slots.probe, queue, clock))
        self.summary, self._breaker, self._clock = (
            committer.summary,
            committer.breaker,
            committer.run_clock,
        )
        self._committer = committer
        loop = asyncio.ensure_future(committer.run(until_empty, follow))
        port = committer.port()
        self.summary.concurrency = self.settings.concurrency
        workers = [
            asyncio.ensure_future(deliver(port, self.send))
            for _ in range(self.settings.concurrency)
        ]
        self._stop = stop = asyncio.Event()
        self._started(committer)
        reason, failure = "ended", None
        try:
            # (unlike gather, a cancelled wait spares the workers)
            all_sent = asyncio.ensure_future(asyncio.wait(workers))
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([all_sent, stopped], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                reason = "cancelled"
                await self._wind_down(committer, loop, workers, reason)
                raise
            finally:
                all_sent.cancel()
                stopped.cancel()
            if stop.is_set() and not all(task.done() for task in workers):
                reason = "stopped"
                await self._wind_down(committer, loop, workers, reason)
                return self.summary
            await committer.close(loop)
            self._limit_in_summary()
            failure = first_failure([loop, *workers]) or committer.failure
            if failure is not None:  # a coroutine's unexpected failure is the run's
                reason = "failed"
                raise failure
            if max_jobs is not None and committer.budget == 0:
                reason = "max_jobs"
            return self.summary
        finally:
            self._stop = None
            self._stopped(reason, failure)

    def _started(self, committer: Committer) -> None:
        settings, rate = self.settings, self.settings.rate
        self._events.emit(
            "started",
            "started",
            concurrency="auto" if self.adaptive else settings.concurrency,
            lease_ms=settings.lease_ms,
            timeout_s=getattr(self.send, "timeout_s", None),
            rate=None if rate is None else rate.per_s,
        )

    async def _wind_down(
        self,
        committer: Committer,
        loop: asyncio.Future[None],
        workers: Sequence[asyncio.Future[None]],
        reason: str,
    ) -> None:
        """Claim nothing more, give sends in flight ``grace_s``, commit what came back."""
        self._events.emit(
            "stopping",
            "stopping: no more claims, sends in flight finish",
            reason=reason,
            grace_s=self.grace_s,
        )
        self._limit_in_summary()
        committer.drain()

        async def settle() -> None:
            self._winding = workers
            if self._hurried:
                self.hurry()
            _, late = await asyncio.wait(workers, timeout=self.grace_s)
            for task in late:  # abandoned jobs stay leased and are reclaimed later
                task.cancel()
            await asyncio.wait(workers)
            await committer.close(loop)

        again = await unshaken(settle(), self.hurry)  # cancelled again: ``hurry``
        first_failure([loop, *workers])
        if again:
            raise asyncio.CancelledError

    def hurry(self) -> None:
        """End a stop's grace now, or as soon as the run stops (a stop asked for again):
        sends still in flight are abandoned, their jobs stay leased."""
        self._hurried = True
        for task in self._winding:
            task.cancel()

    def _stopped(self, reason: str, failure: BaseException | None) -> None:
        summary = self.summary
        self._events.emit(
            "stopped",
            "stopped",
            logging.ERROR if failure is not None else logging.INFO,
            reason=reason,
            done=summary.done,
            dead=summary.dead,
            error=None if failure is None else one_line(failure),
            summary=summary.as_dict(),
        )

    def _limit_in_summary(self) -> None:
        """Concurrency "auto": the summary's concurrency is the adaptive limit (a run
        stopped by cancellation included)."""
        if self._gate is not None:
            self.summary.concurrency = self._gate.limit
            self.summary.concurrency_cuts = self._gate.cuts


@dataclass
class Running:
    """An endpoint's Dispatcher as it runs."""

    made_with: tuple[object, ...]
    dispatcher: Dispatcher
    task: asyncio.Future[Summary]
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


class Fleet:
    """One worker for every endpoint of ``queue``: ``await Fleet(queue).run()``.

    The endpoints are read in one statement every ``refresh_s``; each enabled endpoint has a
    Dispatcher of its own in its lane (``in_lane``: its claims take that endpoint's
    deliveries alone) on the queue's connection, sending through an ``EndpointSend`` fed
    with the row as last read: its own breaker, in-flight limit (the row's concurrency),
    rate row (``rate_key``) and retry schedule.  An endpoint away, throttled or at its
    limit claims nothing more and spends no attempt beyond its breaker's probes; a backlog
    of one never stands in front of another's deliveries.  A disabled or removed endpoint
    has no Dispatcher: none of its deliveries is claimed.  A change of what a Dispatcher
    is made with (``fleet.plan``) stops it (no more claims; sends in flight finish; results
    committed) and starts a new one.  The rows and the jobs are the only state: a worker
    killed at any point loses nothing.  While the database is away the endpoints as last
    read go on; a Dispatcher that fails is logged and started again after ``refresh_s``.
    The lanes' transactions share one while they wait (``asnackq.store.joint``).

    ``owner`` names the leases of every endpoint's Dispatcher; ``sender_options`` go to each
    ``EndpointSend`` (``allow_remote``, ``allow_networks``, TLS files); ``options`` to each
    ``Dispatcher`` (``lease_ms``, ``breaker``, ``retry`` - the pace of re-sends while an
    endpoint is away -, ``gather_ms``, ``keep_attempts``, ``grace_s``, ``jitter``, ``clock``,
    ``trace``, ``prefetch``).  ``max_concurrency``: the most sends in flight to an endpoint
    whose concurrency is "auto".  ``idle_ms``: how often an idle lane looks for new
    deliveries (None: ``idle_ms_for`` the number of endpoints).  ``on_start(name,
    dispatcher)`` and ``on_stop(name, dispatcher)`` are called as endpoints' Dispatchers
    start and end (a metrics exporter follows them so).
    """

    def __init__(
        self,
        queue: AsyncQueue,
        *,
        owner: str | None = None,
        refresh_s: float = fl.REFRESH_S,
        max_concurrency: int = fl.AUTO_MAX,
        idle_ms: int | None = None,
        sender_options: dict[str, Any] | None = None,
        on_start: Callable[[str, Dispatcher], object] | None = None,
        on_stop: Callable[[str, Dispatcher], object] | None = None,
        **options: Any,
    ) -> None:
        if queue.intakes_only or queue.lane is not None:
            raise ValueError("a fleet runs on a queue of its own (AsyncQueue.connect), no lane")
        if type(refresh_s) not in (int, float) or not 0.01 <= refresh_s <= 60:
            raise ValueError(f"refresh_s must be a number of seconds in 0.01..60: {refresh_s!r}")
        w.check_int(max_concurrency, "max_concurrency", 1, 1024)
        if idle_ms is not None:
            w.check_int(idle_ms, "idle_ms", 1, 60_000)
        for hook in (on_start, on_stop):
            if hook is not None and not callable(hook):
                raise ValueError(f"on_start and on_stop must be callable: {hook!r}")
        self.queue, self.refresh_s = queue, refresh_s
        self.owner = owner if owner is not None else default_owner()
        w.check_identifier(self.owner, "owner")
        self.max_concurrency, self.idle_ms = max_concurrency, idle_ms
        self.sender_options = dict(sender_options or {})
        self.options = options
        self.on_start, self.on_stop = on_start, on_stop
        self.rows: dict[str, ep.Endpoint] = {}  # the endpoints as last read
        self.running: dict[str, Running] = {}
        self.summaries: dict[str, Summary] = {}  # each endpoint's runs, added up
        self.failures = 0  # Dispatchers that failed (started again)
        self._noted_at = -math.inf  # the loop's clock at the last note
        self.refused: dict[str, int] = {}  # endpoints not served: the row's updated_ms then
        self._wake = asyncio.Event()
        self._follow = True  # each Dispatcher's run: until cancelled, or until its lane empties
        # Dispatchers are checked when made: a bad option is refused before any run
        Dispatcher(queue, _never_sent, owner=self.owner, **options)

    def dispatchers(self) -> dict[str, Dispatcher]:
        """The running Dispatchers, by endpoint."""
        return {name: running.dispatcher for name, running in self.running.items()}

    def wake(self, endpoints: Iterable[str] | None = None) -> None:
        """New deliveries were enqueued (for ``endpoints``; None: any): their lanes look now,
        not at their next idle poll."""
        names = list(self.running if endpoints is None else endpoints)
        for name in names:
            running = self.running.get(name)
            if running is not None:
                running.dispatcher.wake()
        if endpoints is None or not set(names) <= set(self.running):
            self._wake.set()  # (an endpoint without a Dispatcher yet: read the rows now)

    async def run(self, *, until_empty: bool = False) -> dict[str, Summary]:
        """Deliver until cancelled (or, ``until_empty``, until every enabled endpoint's
        lane holds no pending or leased delivery); each endpoint's summary."""
        self._follow = not until_empty
        self.queue.published.append(self.wake)
        try:
            await self._refresh()
            while not (until_empty and not self.running):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # (not ``wait_for``: ``breaker.admit``)
                    async with asyncio.timeout(self.refresh_s):
                        await self._wake.wait()
                await self._reap(until_empty)
                if not until_empty:
                    await self._refresh()
                await self._note()
        finally:
            self.queue.published.remove(self.wake)
            again = await unshaken(self._stop_all(), self._hurry)
            self._noted_at = -math.inf
            again = await unshaken(self._note()) or again  # (none served: its rows go)
            if again:
                raise asyncio.CancelledError
        return self.summaries

    async def _note(self) -> None:
        """Say what this worker sees of each endpoint it serves, at most every
        ``fl.NOTE_S`` (``AsyncQueue.note_endpoints``: shown by stats and the dashboard)."""
        now = asyncio.get_running_loop().time()
        if now - self._noted_at < fl.NOTE_S:
            return
        self._noted_at = now
        if self.queue.closing:  # (closed under the run: nothing to say, nowhere)
            return
        rows = [(name, *fl.seen(running.dispatcher)) for name, running in self.running.items()]
        with contextlib.suppress(StoreUnavailable):  # (the next one says it)
            await self.queue.note_endpoints(self.owner, rows)

    async def _refresh(self) -> None:
        """Read the endpoints; start, restart and stop Dispatchers to match."""
        try:
            rows = {row.name: row for row in await self.queue.endpoints()}
        except StoreUnavailable:
            return  # the endpoints as last read go on
        self.rows = rows
        for name in [name for name in self.running if self._stale(name)]:
            await self._stop(name)
        idle_ms = self.idle_ms or fl.idle_ms_for(
            sum(row.state == "enabled" for row in rows.values())
        )
        for name, row in rows.items():
            waits = self.refused.get(name) == row.updated_ms  # (refused: until it changes)
            if row.state == "enabled" and name not in self.running and not waits:
                await self._start(row, idle_ms)

    def _stale(self, name: str) -> bool:
        row = self.rows.get(name)
        return row is None or row.state != "enabled" or fl.plan(row) != self.running[name].made_with

    async def _start(self, row: ep.Endpoint, idle_ms: int) -> None:
        lane = self.queue.in_lane(lanes.Lane(row.name, ordered=row.ordered))
        lane.limits = fl.LANE_LIMITS
        stack = contextlib.AsyncExitStack()
        try:
            if row.rate is None:  # none of its own: an earlier rate row binds it no more
                await lane.clear_rate()
            send = await stack.enter_async_context(
                EndpointSend(
                    row.name,
                    read=partial(self._row, row.name),
                    disable=partial(self.queue.disable_endpoint, row.name),
                    payload=self.queue.delivery,
                    refresh_s=self.refresh_s,
                    **self.sender_options,
                )
            )
            dispatcher = Dispatcher(lane, send, **self._dispatcher_options(row, idle_ms))
        except QueueClosed:  # (no row's fault: the run stops with it)
            await stack.aclose()
            raise
        except ValueError as error:  # its row, as this worker reads it: until it changes
            await stack.aclose()
            self.refused[row.name] = row.updated_ms
            logger.warning("endpoint %s not served: %s", row.name, one_line(error))
            return
        except StoreUnavailable:  # (tried again at the next refresh)
            await stack.aclose()
            return
        except BaseException:  # (cancelled while it started: its senders closed)
            await asyncio.shield(stack.aclose())
            raise
        task = asyncio.ensure_future(dispatcher.run(follow=self._follow))
        self.running[row.name] = Running(fl.plan(row), dispatcher, task, stack)
        if self.on_start is not None:
            self.on_start(row.name, dispatcher)

    def _dispatcher_options(self, row: ep.Endpoint, idle_ms: int) -> dict[str, Any]:
        concurrency = row.concurrency
        return {
            "owner": self.owner,
            "idle_ms": idle_ms,
            **self.options,
            "concurrency": concurrency,
            "max_concurrency": self.max_concurrency if concurrency == "auto" else concurrency,
            "schedule": ep.schedule_of(row),
            "rate": row.rate,
            "burst": row.burst,
        }

    async def _row(self, name: str) -> ep.Endpoint:
        row = self.rows.get(name)
        if row is None:
            raise ep.NoSuchEndpoint(f"no endpoint {name!r}")
        return row

    async def _reap(self, until_empty: bool) -> None:
        """Dispatchers that ended: emptied (``until_empty``) or failed (started again at
        the next refresh)."""
        for name, running in list(self.running.items()):
            if running.task.done():
                failure = None if running.task.cancelled() else running.task.exception()
                if failure is not None:
                    self.failures += 1
                    logger.error("endpoint %s: its run failed: %s", name, one_line(failure))
                await self._stop(name)

    async def _stop(self, name: str) -> None:
        """Stop an endpoint's Dispatcher as a cancellation does: no more claims, sends in
        flight get its grace, their results are committed."""
        self.running[name].task.cancel()
        await self._ended(name)

    async def _ended(self, name: str) -> None:
        """Wait for an endpoint's cancelled (or ended) Dispatcher, add its summary up and
        close its sends.  It is cancelled once: a second cancellation would cut its wind
        down short (sends in flight and their results abandoned)."""
        running = self.running[name]
        await asyncio.wait([running.task])  # (still running: ``_hurry`` reaches it)
        del self.running[name]
        fl.add(self.summaries, name, running.dispatcher.summary)
        await running.stack.aclose()
        if self.on_stop is not None:
            self.on_stop(name, running.dispatcher)

    def _hurry(self) -> None:
        """Cancelled again while stopping: every Dispatcher's grace ends now."""
        for running in self.running.values():
            running.dispatcher.hurry()  # (not a second cancel: it may land with the first)

    async def _stop_all(self) -> None:
        for running in self.running.values():
            running.task.cancel()  # (every one winds down at once)
        for name in list(self.running):
            await self._ended(name)


async def _never_sent(event: dict[str, Any], token: int | None = None) -> object:
    raise AssertionError("a fleet's options are checked with this send: it is never called")


async def unshaken(step: Awaitable[object], hurry: Callable[[], None] | None = None) -> bool:
    """Await ``step`` to its end however often the caller is cancelled meanwhile (each
    cancellation calls ``hurry``: a stop asked for again ends its grace, never its
    clean-up); whether the caller was cancelled meanwhile (then it re-raises)."""
    task, caller = asyncio.ensure_future(step), asyncio.current_task()
    cancelled = False
    if caller is not None and caller.cancelling() > 1 and hurry is not None:
        hurry()  # (asked again before it got here: with the first, or while it unwound)
    while True:
        try:
            await asyncio.shield(task)
            return cancelled
        except asyncio.CancelledError:
            if task.done():  # (the step itself was cancelled: the loop is closing)
                raise
            cancelled = True
            if hurry is not None:
                hurry()


async def outlasting(call: Callable[[], Awaitable[T]]) -> T:
    """``await call()``, again after each ``StoreUnavailable`` (its transaction committed
    nothing, or an idempotent write: the store reconnects meanwhile), as the committer's
    loop waits out an outage: a run starting while its database is away starts when it
    is back."""
    while True:
        try:
            return await call()
        except StoreUnavailable as error:
            await asyncio.sleep(max(error.retry_in_s, 0.01))


def default_owner() -> str:
    """A worker's name when none is given: ``host-pid-random`` (the contract's owner
    characters only, at most 64), unique to this Dispatcher among the queue's workers."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname() or "host")[:40].strip("-")
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(4)}"


def check_send(send: object) -> None:
    """Refuse a ``send`` the run could not await as ``await send(event, token)``: one that
    does not take two positional arguments, or is not async (a coroutine function, an
    object with an async ``__call__``, or a function annotated to return an awaitable)."""
    try:
        signature = inspect.signature(send)  # type: ignore[arg-type]  # (checked callable)
    except (TypeError, ValueError):  # a builtin without one: judged by its first send
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"send must accept (event, token) positionally; its signature is {signature}"
        ) from None
    call = getattr(send, "__call__", None)  # noqa: B004  # (its own __call__, if an object)
    annotation = str(signature.return_annotation)
    if not (
        inspect.iscoroutinefunction(send)
        or inspect.iscoroutinefunction(call)
        or any(kind in annotation for kind in ("Awaitable", "Coroutine", "Future"))
    ):
        raise ValueError(
            f"send must be async (async def, or an object with an async __call__): {send!r}"
        )


def first_failure(tasks: list[asyncio.Future[None]]) -> BaseException | None:
    """The first exception of these finished tasks; every task's is retrieved, so none is
    ever reported as "never retrieved"."""
    failures = [task.exception() for task in tasks if not task.cancelled()]
    return next((failure for failure in failures if failure is not None), None)
