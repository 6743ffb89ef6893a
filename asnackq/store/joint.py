"""The transactions of one queue's lanes share one while they wait: group commit across
endpoints.

A fleet (``asnackq.dispatch.fleet``) runs a Dispatcher per endpoint on one ``AsyncQueue``:
one connection, one lock.  Each Dispatcher's committer batches its own endpoint's claims
and finishes into a cycle, but a hundred endpoints would still pay a hundred durable
COMMITs where one Dispatcher pays one.  Here, the lanes' transactions that arrive while
another holds the lock join one transaction, taken when it gets the lock.

Rules of this module:

1. **Each plan runs as if alone.**  A joint transaction runs its plans one after the other,
   in arrival order, each exactly the statements it would run alone (its lane's texts,
   its own clock reading); lanes hold disjoint jobs and rate rows, so no plan reads what
   another wrote.  A plan alone in its transaction runs exactly as without the joint.
2. **Each caller gets its own fate.**  A joint transaction that fails for a reason other
   than the store's (``StoreUnavailable``, ``CommitUnknown``: every caller's, as it would
   have been each one's alone) is rolled back and its plans run again one per
   transaction, so an error that belongs to one plan reaches that caller only (a plan is
   made again for each try, as the store makes it again for a re-run).
3. **No wait is added.**  A plan that finds no transaction waiting starts one at once; the
   joint closes when its transaction takes the lock.  A caller that is cancelled waits
   for its transaction to end, then re-raises (as ``AsyncQueue``'s transactions do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from asnackq.core import worker as w
from asnackq.store.outage import StoreUnavailable

__all__ = ["Joint"]

Run = Callable[[w.Make], Awaitable[Any]]  # runs a plan in a transaction of its own


class _Call:
    def __init__(self, make: w.Make) -> None:
        self.make = make
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def settle(self, result: object) -> None:
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


class _Batch:
    """Plans waiting for one transaction; closed once it has the lock."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.taken: list[_Call] | None = None

    def plan(self) -> w.Plan[list[Any]]:
        """Every plan taken, in arrival order, each as it runs alone; their results."""
        if self.taken is None:
            self.taken = list(self.calls)
        results: list[Any] = []
        wrote = False
        for call in self.taken:
            result, changed = yield from call.make()
            results.append(result)
            wrote = wrote or changed
        return results, wrote


class Joint:
    """Gathers the concurrent transactions of one queue's lanes (see the module)."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._open: _Batch | None = None
        self._landing: set[asyncio.Future[None]] = set()

    async def run(self, make: w.Make) -> Any:
        """Run ``make``'s plan (validated by the caller) in the next joint transaction."""
        call = _Call(make)
        batch = self._open
        if batch is None or batch.taken is not None:
            batch = self._open = _Batch()
            task = asyncio.ensure_future(self._land(batch))
            self._landing.add(task)
            task.add_done_callback(self._landing.discard)
        batch.calls.append(call)
        try:
            return await asyncio.shield(call.future)
        except asyncio.CancelledError:
            await asyncio.wait([call.future])  # let its transaction end, then re-raise
            raise

    async def _land(self, batch: _Batch) -> None:
        try:
            results = await self._run(batch.plan)
        except StoreUnavailable as error:
            for call in self._closed(batch):
                call.settle(error)
        except Exception as error:
            taken = self._closed(batch)
            if len(taken) == 1:  # alone: its own error already
                taken[0].settle(error)
                return
            for call in taken:  # each alone: its own fate
                await self._settle(call)
        except BaseException:
            for call in self._closed(batch):
                call.future.cancel()
            raise
        else:
            for call, result in zip(self._closed(batch), results, strict=True):
                call.settle(result)

    def _closed(self, batch: _Batch) -> list[_Call]:
        """The batch's calls, no call joining it any more (it may have failed before its
        plan ever ran: then every call that joined it is its)."""
        if self._open is batch:
            self._open = None
        if batch.taken is None:
            batch.taken = list(batch.calls)
        return batch.taken

    async def _settle(self, call: _Call) -> None:
        try:
            call.settle(await self._run(call.make))
        except Exception as error:
            call.settle(error)
        except BaseException:
            call.future.cancel()
            raise
