"""The gate of ``concurrency="auto"``: delivery coroutines hold a slot while they take and
send a ticket, and there are never more slots taken than the adaptive limit.

Rules of this module:

* A coroutine takes a slot before it takes a ticket: the committer claims for the
  coroutines the limit lets through, not for every coroutine of the run.
* Each send is timed on the event loop's clock and its outcome told to the rule
  (``asnackq.dispatch.adaptive``); a send the sink answered with an overload gives its slot
  back while it waits out the sink's ``Retry-After``, and takes it back at once when the
  wait is over, past the limit if need be: the coroutines holding the slots may be waiting
  for a ticket, and the run for this one.
* A lowered limit takes effect as slots are given back: no send in flight is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from asnackq.core import worker as w
from asnackq.dispatch.adaptive import Aimd, Outcome
from asnackq.store.aio import AsyncSend

__all__ = ["Gate"]


class Gate:
    """At most ``rule.limit`` slots taken at once; waiters served in order."""

    def __init__(self, max_limit: int) -> None:
        self.clock = asyncio.get_running_loop().time
        self.rule = Aimd(max_limit, self.clock)
        self.taken = 0
        self.sending = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def limit(self) -> int:
        return self.rule.limit

    async def acquire(self) -> None:
        """Wait for a slot, and take it."""
        if self.taken < self.limit and not self._waiters:
            self.taken += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # the slot is taken for us when we are woken
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # woken, then cancelled: the slot goes to the next
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Give a slot back."""
        self.taken -= 1
        self._wake()

    def retake(self) -> None:
        """Take a slot back at once, past the limit if need be."""
        self.taken += 1

    def _wake(self) -> None:
        while self._waiters and self.taken < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.taken += 1
                waiter.set_result(None)

    async def send(self, send: AsyncSend, event: dict[str, Any], token: int) -> object:
        """``send(event, token)``, timed, its outcome told to the rule."""
        began = self.clock()
        self.sending += 1
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
                self.rule.observe(began, self.clock() - began, outcome, self.sending)
            self.sending -= 1
            self._wake()
