"""The gate of ``concurrency="auto"``: never more sends in flight than the adaptive limit,
and never more tickets held by coroutines than the limit and a short line waiting to send.

Rules of this module:

* A coroutine takes a holder's place before it takes a ticket, and keeps it until the
  send ends: the committer claims for the coroutines the gate lets through (at most
  ``limit + depth(limit)``), not for every coroutine of the run.
* A send takes a send slot (at most ``limit``) only for the send itself: a coroutine
  waiting for a ticket or a commit never keeps the sink's capacity unused, and a ticket
  waits at most about ``depth / limit`` of a send for its slot.
* Each send is timed on the event loop's clock and its outcome told to the rule
  (``asnackq.dispatch.adaptive``); a ticket the sink answered with an overload keeps its
  holder's place while it waits out the sink's ``Retry-After``: a sink refusing every
  request meets no more tickets than the bound.
* A lowered limit takes effect as sends end: no send in flight is cancelled.
* Waiters are served in order.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from asnackq.core import worker as w
from asnackq.dispatch.adaptive import Aimd, Outcome
from asnackq.wire.send import AsyncSend

__all__ = ["Gate", "depth"]


def depth(limit: int) -> int:
    """How many tickets may wait for a send slot: half the limit, at least one."""
    return max(1, -(-limit // 2))


class Line:
    """At most ``bound()`` places taken at once; waiters served in order."""

    def __init__(self, bound: Any) -> None:
        self.bound = bound
        self.taken = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        """Wait for a place, and take it."""
        if self.taken < self.bound() and not self._waiters:
            self.taken += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # the place is taken for us when we are woken
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # woken, then cancelled: the place goes to the next
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Give a place back."""
        self.taken -= 1
        self.wake()

    def wake(self) -> None:
        while self._waiters and self.taken < self.bound():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.taken += 1
                waiter.set_result(None)


class Gate:
    """Holders (``limit + depth(limit)``) and sends (``limit``) under the adaptive limit."""

    def __init__(self, max_limit: int) -> None:
        self.clock = asyncio.get_running_loop().time
        self.rule = Aimd(max_limit, self.clock)
        self.holders = Line(lambda: self.limit + depth(self.limit))
        self.sends = Line(lambda: self.limit)

    @property
    def limit(self) -> int:
        return self.rule.limit

    @property
    def cuts(self) -> int:
        """How many times the adaptive limit was cut."""
        return self.rule.cuts

    @property
    def sending(self) -> int:
        return self.sends.taken

    async def acquire(self) -> None:
        """Wait for a holder's place (before taking a ticket), and take it."""
        await self.holders.acquire()

    def release(self) -> None:
        """Give a holder's place back."""
        self.holders.release()

    async def send(self, send: AsyncSend, event: dict[str, Any], token: int) -> object:
        """``send(event, token)`` in a send slot, timed, its outcome told to the rule."""
        await self.sends.acquire()
        began = self.clock()
        outcome: Outcome | None = "ok"  # (any answer but an overload)
        try:
            return await send(event, token)
        except w.Overloaded:
            outcome = "overload"
            raise
        except w.Unavailable:
            outcome = "failure"
            raise
        except asyncio.CancelledError:
            outcome = None  # the run is stopping: no sample
            raise
        finally:
            if outcome is not None:
                self.rule.observe(began, self.clock() - began, outcome, self.sends.taken)
            self.sends.release()
            self.holders.wake()  # (a new limit may let more hold tickets)
