"""The transactions of one queue's lanes share one while they wait: group commit across
endpoints (and, on a file, the intakes ride the queue's transactions: ``Riders``).

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
   made again for each try, as the store makes it again for a re-run).  When a rider
   (``Riders``) failed it, the riders run alone and the joint runs again whole first.
3. **No wait is added.**  A plan that finds no transaction waiting starts one at once; the
   joint closes when its transaction takes the lock.  A caller that is cancelled waits
   for its transaction to end, then re-raises (as ``AsyncQueue``'s transactions do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from asnackq.core import worker as w
from asnackq.store.outage import StoreUnavailable

__all__ = ["Gathering", "Joint", "Riders", "Underway", "Waiter", "settle"]

Run = Callable[[w.Make], Awaitable[Any]]  # runs a plan in a transaction of its own
ADOPTED: Any = object()  # a batch's result when another transaction ran its calls


class Waiter:
    """One call waiting for a shared transaction: its fate, set once."""

    def __init__(self) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def settle(self, result: object) -> None:
        settle(self.future, result)


def settle(future: asyncio.Future[Any], outcome: object) -> None:
    """Give ``future`` its outcome (an exception is raised to its awaiter), unless it is done
    already (its caller gone, or settled)."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


T = TypeVar("T")


class Underway:
    """Tasks under way, each forgotten once done (what a close waits for)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def add(self, task: asyncio.Future[T]) -> asyncio.Future[T]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __bool__(self) -> bool:
        return bool(self._tasks)

    async def drained(self) -> None:
        """Return once none is under way (one added meanwhile is waited for too)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))


CallT = TypeVar("CallT", bound=Waiter)


class _Batch(Generic[CallT]):
    """Calls waiting for one transaction; closed once its plan first runs (under the lock),
    or once its transaction ended without running it."""

    def __init__(self) -> None:
        self.calls: list[CallT] = []
        self.taken: list[CallT] | None = None
        self.adopted = False  # run in another transaction (``Riders.adopt``)
        self.landing: asyncio.Future[None] | None = None  # its task: ends once it ended


class Gathering(Generic[CallT]):
    """Calls gathered into the next shared transaction, each given its own fate (rules 2
    and 3 of the module; ``Joint`` and ``Riders`` here and ``asnackq.store.intakes.Intakes``
    are its kinds).  A kind says how its calls run together (``_together``), how one runs alone
    (``_alone``) and where a transaction runs (``_transact``)."""

    def __init__(self) -> None:
        self._open: _Batch[CallT] | None = None
        self._landing = Underway()

    def _together(self, calls: list[CallT]) -> w.Plan[list[Any]]:
        raise NotImplementedError

    def _alone(self, call: CallT) -> w.Make:
        raise NotImplementedError

    async def _transact(self, make: w.Make) -> Any:
        raise NotImplementedError

    async def _transact_batch(self, make: w.Make, batch: _Batch[CallT]) -> Any:
        """``batch``'s transaction (its plan ``make``): ``_transact``'s, unless a kind
        says otherwise (``Riders``: none, once another transaction took the batch)."""
        return await self._transact(make)

    async def _join(self, call: CallT) -> Any:
        """``call``'s result, from the next shared transaction."""
        batch = self._open
        if batch is None or batch.taken is not None:
            batch = self._open = _Batch()
            batch.landing = self._landing.add(asyncio.ensure_future(self._land(batch)))
        batch.calls.append(call)
        try:
            return await call.future  # (its cancellation cancels it: its result is dropped)
        except asyncio.CancelledError:
            if batch.landing is not None:  # (it is: made with the batch)
                await asyncio.wait([batch.landing])  # let its transaction end, then re-raise
            raise

    async def _land(self, batch: _Batch[CallT]) -> None:
        def plan() -> w.Plan[list[Any]]:
            if batch.taken is None:
                batch.taken = list(batch.calls)
            return (yield from self._together(batch.taken))

        try:
            results = await self._transact_batch(plan, batch)
            if results is ADOPTED:  # each call settled by the transaction that ran it
                for call in batch.taken or ():
                    call.future.cancel()  # (none is left: a safety net, never an endless wait)
                return
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

    def _closed(self, batch: _Batch[CallT]) -> list[CallT]:
        """The batch's calls, no call joining it any more (it may have failed before its
        plan ever ran: then every call that joined it is its)."""
        if self._open is batch:
            self._open = None
        if batch.taken is None:
            batch.taken = list(batch.calls)
        return batch.taken

    async def _settle(self, call: CallT) -> None:
        try:
            call.settle(await self._transact(self._alone(call)))
        except Exception as error:
            call.settle(error)
        except BaseException:
            call.future.cancel()
            raise

    @property
    def busy(self) -> bool:
        """Whether a transaction is under way (or a batch waits for one)."""
        return bool(self._landing)

    async def drained(self) -> None:
        """Wait for the transactions under way."""
        await self._landing.drained()


class _Call(Waiter):
    def __init__(self, make: w.Make) -> None:
        super().__init__()
        self.make = make


class Joint(Gathering[_Call]):
    """Gathers the concurrent transactions of one queue's lanes (see the module)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self._run = run

    async def run(self, make: w.Make) -> Any:
        """Run ``make``'s plan (validated by the caller) in the next joint transaction."""
        return await self._join(_Call(make))

    def _together(self, calls: list[_Call]) -> w.Plan[list[Any]]:
        """Every plan taken, in arrival order, each as it runs alone; their results."""
        results: list[Any] = []
        wrote = False
        for call in calls:
            result, changed = yield from call.make()
            results.append(result)
            wrote = wrote or changed
        return results, wrote

    def _alone(self, call: _Call) -> w.Make:
        return call.make

    async def _transact(self, make: w.Make) -> Any:
        return await self._run(make)


class Riders(Joint):
    """A file's intakes, riding the queue's own transactions: one COMMIT for both.

    On a file, intakes and the queue's transactions (a Dispatcher's cycles) take turns on
    one connection, each paying its own durable COMMIT: a producer's transactions of 128
    events held the lock half the time beside a Dispatcher at 64.  Here the intakes'
    transactions gather as a ``Joint``'s do, and a transaction of the queue's own that ends
    while they wait for the lock takes them (``adopt``; ``AsyncQueue._hosting``):

    1. **Each plan runs as if alone.**  The riders' plans run after the host's plan, before
       its COMMIT, in arrival order, each exactly the statements it runs alone: what they
       read is what they would read right after the host's COMMIT, where they would have
       run next, and the host's plan never reads what they write.
    2. **Each caller gets its own fate.**  A store outage (``StoreUnavailable``) reaches the
       host and every rider, as it would have reached each alone.  Any other failure of a
       transaction with riders rolls it back, then runs each rider alone and the host
       alone after them, each its own fate.
    3. **No wait is added.**  A rider waiting when a host's plan ends runs in that host's
       transaction; one that comes later (during the host's COMMIT) runs in its own once
       it takes the lock, or in the next host's; a batch taken by a host opens no
       transaction of its own when its turn at the lock comes.
    4. **Hosts** are the queue's transactions that are no intake and have no fault hook (a
       hook's test sees the host's statements alone), a fleet's joint ones too; a rider
       never hosts.
    """

    def __init__(self, run: Callable[..., Awaitable[Any]]) -> None:
        super().__init__(run)
        self._turn = run  # runs a plan under the lock, unless ``skip()`` says it is taken

    async def _transact_batch(self, make: w.Make, batch: _Batch[_Call]) -> Any:
        return await self._turn(make, skip=lambda: batch.adopted)

    def adopt(self) -> list[_Call]:
        """The calls of the batch waiting for the lock, taken to run at the end of the
        transaction that holds it (which gives each its fate); none when none waits."""
        batch = self._open
        if batch is None or batch.taken is not None or not batch.calls:
            return []
        batch.taken, batch.adopted = list(batch.calls), True
        self._open = None
        return batch.taken
