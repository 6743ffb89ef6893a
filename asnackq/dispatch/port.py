"""What a delivery coroutine sees of its run: tickets in, results out, the leases it sends under.

Rules of this module:

* A coroutine never sees the committer: it takes tickets and hands results back through a
  ``Port``, asks whether the run still keeps a lease, and shares the run's breaker, clock
  and counts of sends.
* Values that travel between the coroutines and the committer are named here:
  ``Claimed`` out, ``Sent`` back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from asnackq.core import worker as w
from asnackq.dispatch.breaker import Breaker
from asnackq.dispatch.gate import Gate
from asnackq.dispatch.ledger import Ledger
from asnackq.dispatch.runclock import RunClock
from asnackq.dispatch.settings import Settings
from asnackq.dispatch.summary import Summary
from asnackq.dispatch.tickets import Claimed, Sent

__all__ = ["LATE_S", "LATE_SLOTS", "Port"]

# A send more than this late for its slot takes a new one: at most LATE_S, or LATE_SLOTS
# slots' worth if longer, of sends ever go out late at once.
LATE_S = 0.02
LATE_SLOTS = 2


@dataclass(frozen=True, kw_only=True)
class Port:
    """A delivery coroutine's narrow view of its run."""

    take: Callable[[], Awaitable[Claimed | None]]  # the next ticket; None: no more
    again: Callable[[], Awaitable[float | None]]  # a new send slot (None: the run ended)
    hand_back: Callable[[Sent], None]
    drain: Callable[[], None]  # claim nothing more (the coroutine fails the run)
    ledger: Ledger  # read only: which leases the run keeps
    now: RunClock
    breaker: Breaker
    summary: Summary  # the coroutine counts its requests
    settings: Settings
    gate: Gate | None = None  # concurrency "auto": the slots a coroutine takes

    def keeps(self, ticket: w.Ticket) -> bool:
        """Whether the run still holds this lease now (a send may go under it)."""
        return self.ledger.keeps(ticket, self.now())

    async def slot(self, claimed: Claimed, again: bool = False) -> bool:
        """Wait for the ticket's send slot under a shared rate (``again``: a new one, for a
        re-send under the same lease); a slot missed by more than ``late_s`` (a stalled
        process, a ticket that waited for a coroutine) is exchanged for a new one, never
        sent late in a bunch.  Whether the run still holds the lease when the slot comes
        (False: do not send)."""
        rate, slot = self.settings.rate, claimed.not_before
        if rate is None:
            return True
        again = again or not slot  # (claimed before the run kept to a rate: a slot now)
        clock = asyncio.get_running_loop().time
        late_s = max(LATE_S, LATE_SLOTS / rate.per_s)
        while again or clock() - slot > late_s or clock() < slot:
            if not again and clock() < slot:
                await asyncio.sleep(slot - clock())
                continue
            new = await self.again()
            if new is None:
                return False
            slot, again = new, False
        return self.keeps(claimed.ticket)

    def lease_left_s(self, ticket: w.Ticket) -> float:
        """Seconds until the run's current lease on this ticket ends (0: not held)."""
        until = self.ledger.lease_until(ticket)
        return 0.0 if until is None else max(0.0, (until - self.now()) / 1000)

    async def hold(self, ticket: w.Ticket, seconds: float) -> bool:
        """Wait ``seconds`` under this ticket's lease (the committer extends it meanwhile, up
        to the job's deadline); False as soon as the run no longer keeps it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while (left := until - loop.time()) > 0:
            lease_s = self.lease_left_s(ticket)
            if lease_s <= 0:
                return False
            await asyncio.sleep(min(left, lease_s))
        return self.keeps(ticket)
