"""Concurrent ``enqueue`` calls on one ``AsyncQueue`` share a transaction: group commit.

A queue has one connection and one lock (``asnackq.aio``, rule 2).  Sixteen request handlers
each calling ``enqueue`` would otherwise take the lock sixteen times, each paying a durable
COMMIT, and a Dispatcher's cycle waiting for the same lock would queue behind all of them.
Here, the calls that arrive while a transaction waits for the lock join it.

Rules of this module:

1. **Each call is judged as if alone.**  A transaction runs the calls in arrival order
   through ``plan_enqueue_many``, which judges each item exactly as a sequential ``enqueue``
   would (a repeat of an id earlier in the same transaction reads False, or a ``Conflict``).
   Calls that name no instant (``now_ms`` None) share the latest of their clock readings:
   each job's instant is one the queue's clock gave before the transaction began, and
   the transaction runs one plan for them, not one per millisecond in which they arrived.
   Calls that name their instant are consecutive plans of their own in the transaction.  A
   call alone in its transaction runs the core's ``plan_enqueue``, exactly as before any
   sharing (a ``Conflict`` rolls that transaction back).  Each call is validated by its
   caller before it joins (``worker.check_enqueue``: a ``ValueError`` is that caller's alone
   and changes nothing), once: the transaction runs those two plans on the checked items.
2. **Each caller gets its own fate.**  A ``Conflict`` (nothing written for it) is raised to
   that caller alone; the others' jobs commit.  A transaction that fails for any
   other reason is run again one call per transaction, so an error that belongs to one call
   reaches that caller only (intakes are idempotent: a job already written reads False).
   A store outage (``StoreUnavailable``, ``CommitUnknown``) reaches every caller of the
   transaction, as it would have reached each alone.
3. **On PostgreSQL the intakes have a session of their own** (``Intakes.own``, opened at
   the first intake; ``enqueue_many`` runs there too): a producer's COMMITs run beside the
   Dispatcher's cycles instead of taking turns with them on the queue's one connection
   (the server orders concurrent transactions by its row locks, as for two workers).  On a
   file the intakes keep the queue's connection and lock: one writer per file.
4. **No wait for time.**  A call that finds no transaction waiting starts one at once; the
   batch closes when its transaction takes the lock.  A batch takes the lock only once the
   batch before it has given its callers their results and the event loop has made one
   more pass, so a caller that enqueues again at once (a handler's loop) joins it rather
   than the one after (which would leave that caller alone in a transaction of its own:
   sixteen such handlers beside a Dispatcher had their transactions alternate between one
   call and fifteen).  A caller that is cancelled waits for its transaction to end, then
   re-raises (as ``AsyncQueue``'s transactions do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from itertools import groupby
from typing import Any

from asnackq.core import worker as w
from asnackq.store.joint import Gathering, Waiter
from asnackq.store.session import Opener, Session

__all__ = ["Intakes"]

Run = Callable[[w.Make], Awaitable[Any]]  # runs a plan in a transaction of its own
Checked = tuple[str, int, int, int, int]  # an intake checked: (id, qty, now_ms, ttl, tries)


class _Call(Waiter):
    """One ``enqueue`` waiting for its transaction: its checked intake (its clock reading
    among them), its fate."""

    def __init__(self, checked: Checked, named: bool) -> None:
        super().__init__()
        self.checked, self.named = checked, named  # named: the instant is the caller's


class Intakes(Gathering[_Call]):
    """Gathers one queue's concurrent intakes into shared transactions (see the module)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self._run = run
        self._own: Session | None = None  # a session of their own (``own``), or None
        self._last: asyncio.Future[Any] | None = None  # the latest batch's landing task

    def own(self, opener: Opener) -> None:
        """Run the intakes on a session of their own, opened by ``opener`` at the first one
        (PostgreSQL: beside the queue's cycles, never behind them; see the module)."""
        self._own = Session(opener)

    async def run(self, make: w.Make) -> Any:
        """Run one intake plan (validated by the caller) where the intakes run."""
        if self._own is None:
            return await self._run(make)
        return await self._own.run(make)

    async def close(self) -> None:
        """Wait for the transactions under way, then close the intakes' own session."""
        await self.drained()
        if self._own is not None:
            await self._own.close()

    async def enqueue(self, checked: Checked, named: bool = True) -> bool:
        """Enqueue one intake (``worker.check_enqueue``'s, by the caller) in the next shared
        transaction: True inserted, False already there; a ``Conflict`` is raised to this
        caller.  ``named`` False: its ``now_ms`` is the queue's clock's reading (rule 1)."""
        return bool(await self._join(_Call(checked, named)))

    def _together(self, calls: list[_Call]) -> w.Plan[list[Any]]:
        """The calls in arrival order, each run of calls with one clock reading as one
        ``plan_enqueue_many`` (which judges each item exactly as a sequential ``enqueue``);
        a call alone runs the core's ``plan_enqueue`` (a Conflict rolls it back)."""
        if len(calls) == 1:
            inserted, wrote = yield from self._alone(calls[0])()
            return [inserted], wrote
        results: list[bool | w.Conflict] = []
        changed = False
        shared = max((call.checked[2] for call in calls if not call.named), default=0)

        def instant(call: _Call) -> int:
            return call.checked[2] if call.named else shared

        for now_ms, run in groupby(calls, key=instant):  # (checked: the core's plan as is)
            items = [
                (job_id, qty, ttl, tries)
                for job_id, qty, _, ttl, tries in (call.checked for call in run)
            ]
            found, wrote = yield from w._enqueue_many(items, now_ms)
            results += found
            changed = changed or wrote
        return results, changed

    def _alone(self, call: _Call) -> w.Make:
        return partial(w._enqueue, *call.checked)  # (checked: the core's plan as is)

    async def _transact(self, make: w.Make) -> Any:
        return await self.run(make)

    async def _transact_batch(self, make: w.Make, batch: object) -> Any:
        """The batch's transaction, once the one before it has landed (rule 4).  Waiting
        for that landing takes as many passes of the event loop as its callers take to
        resume with their results (through ``_join``'s shield); the one more pass leaves
        room for a caller that awaits through a task of its own."""
        previous, self._last = self._last, asyncio.current_task()
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
            await asyncio.sleep(0)
        return await self._transact(make)
