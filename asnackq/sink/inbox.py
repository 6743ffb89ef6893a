"""The group commit: concurrent deliveries decided in one transaction, each exactly as if
it had come alone, in arrival order (every receiver's: ``receiver``, and the sink's).

Rules of this module:

* A delivery waits in line; one task takes every delivery waiting at that moment (at most
  ``batch_max``) and runs them as one batch (``Run``: ``core.inbox.plan_receive`` and the
  effects, in one transaction).  Each delivery's answer is set only after the COMMIT that
  decided it.  With ``batch_max`` 1 each delivery runs alone, in its own request's task.
* An effect that raised for one delivery (``EffectFailed``, ``Rejected`` included) rolled
  its batch back: the deliveries before it run again as a batch and commit, then it runs
  again alone (its answer is that run's), then the ones after it, as a batch.  Nothing of
  a failing effect stays, and no other delivery's answer depends on it; the batch's other
  effects run again (an effect is all inside the transaction: what rolled back is gone).
  Reruns are rare (an effect's failure), so the common batch pays nothing for them, where a
  savepoint per effect would cost every delivery two statements (and PostgreSQL
  subtransactions).
* A batch that cannot commit (``SinkUnavailable``) fails each delivery not yet answered
  and changes nothing - unless its COMMIT's answer was lost and the outcome could not be
  learned (``CommitUnknown``): the batch may then have committed, and a delivery sent again
  finds its id applied (a duplicate, no effect).  One log line when batches begin to fail,
  one when they commit again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from asnackq.core.inbox import Arrival
from asnackq.store.effects import EffectFailed
from asnackq.store.joint import settle
from asnackq.store.targets import one_line

__all__ = ["LOG", "Delivery", "GroupCommit", "Run", "SinkUnavailable"]

LOG = logging.getLogger("asnackq.sink")  # one line each, never a traceback


class Delivery(NamedTuple):
    """A delivery waiting for its decision: what the inbox decides on, and its payload."""

    arrival: Arrival
    payload: Any
    done: asyncio.Future[str]


# One batch in one transaction: each delivery's status once committed (``EffectFailed``
# when an effect raised; anything else: the batch could not commit).
Run = Callable[[list[Delivery]], Awaitable[list[str]]]


class SinkUnavailable(Exception):
    """Raised to a delivery whose batch could not commit (answered 503)."""


class GroupCommit:
    """Deliveries decided in batches, one transaction each (see the module's rules)."""

    def __init__(self, run: Run, batch_max: int) -> None:
        self.run, self.batch_max = run, batch_max
        self.waiting: deque[Delivery] = deque()
        self.drainer: asyncio.Future[None] | None = None
        self.alone: set[asyncio.Future[None]] = set()  # (``batch_max`` 1) deliveries running
        self.commits = 0
        self.failing: float | None = None  # since when batches fail (monotonic seconds)

    async def submit(self, arrival: Arrival, payload: Any) -> str:
        """The delivery's status once committed; its failure raised (``EffectFailed``,
        ``SinkUnavailable``).  A cancelled caller's decision still commits."""
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        delivery = Delivery(arrival, payload, done)
        if self.batch_max == 1:  # alone, in a task of the caller's (its context)
            await self._alone(delivery)
        else:
            self.waiting.append(delivery)
            if self.drainer is None:
                self.drainer = asyncio.ensure_future(self._drain())
        return await done

    async def _alone(self, delivery: Delivery) -> None:
        """Settle one delivery; a cancelled caller waits for its COMMIT or ROLLBACK, then
        the cancellation is raised (the transaction is never split)."""
        settling = asyncio.ensure_future(self._settle([delivery]))
        self.alone.add(settling)
        settling.add_done_callback(self.alone.discard)
        try:
            await asyncio.shield(settling)
        except asyncio.CancelledError:
            delivery.done.cancel()
            await asyncio.wait([settling])
            raise

    async def close(self) -> None:
        """Return once every delivery in hand has been answered."""
        while self.drainer is not None or self.alone:
            await asyncio.wait([*self.alone, *([self.drainer] if self.drainer else [])])

    async def _drain(self) -> None:
        try:
            while self.waiting:
                count = min(len(self.waiting), self.batch_max)
                await self._settle([self.waiting.popleft() for _ in range(count)])
        finally:
            self.drainer = None

    async def _settle(self, batch: list[Delivery]) -> None:
        """Commit ``batch``, splitting it around an effect that raised (the module's rules)."""
        segments = deque([batch])
        while segments:
            segment = segments.popleft()
            try:
                statuses = await self.run(segment)
            except EffectFailed as failed:
                segments.extendleft(reversed(split(segment, failed)))
                continue
            except Exception as error:
                self._failed([d for s in (segment, *segments) for d in s], error)
                return
            self._committed(segment, statuses)

    def _committed(self, segment: list[Delivery], statuses: list[str]) -> None:
        self.commits += 1
        if self.failing is not None:
            down_s = time.monotonic() - self.failing
            LOG.warning("the inbox commits again, after %.1f s", down_s, extra={"event": "db_back"})
            self.failing = None
        for delivery, status in zip(segment, statuses, strict=True):
            answer(delivery, status)

    def _failed(self, deliveries: list[Delivery], error: Exception) -> None:
        if self.failing is None:  # one line when batches begin to fail, one when they end
            self.failing = time.monotonic()
            LOG.warning(
                "the inbox cannot commit (503 until it can): %s",
                one_line(error),
                extra={"event": "db_down"},
            )
        for delivery in deliveries:
            answer(delivery, SinkUnavailable(str(error)))


def split(segment: list[Delivery], failed: EffectFailed) -> list[list[Delivery]]:
    """What runs next after the effect of ``segment[failed.index]`` raised: the deliveries
    before it, then it alone, then the rest; alone already, its failure is its answer."""
    index = failed.index
    if len(segment) == 1:
        answer(segment[0], failed)
        return []
    parts = [segment[:index], segment[index : index + 1], segment[index + 1 :]]
    return [part for part in parts if part]


def answer(delivery: Delivery, outcome: str | Exception) -> None:
    """Settle a delivery's future (unless its caller is gone)."""
    settle(delivery.done, outcome)
