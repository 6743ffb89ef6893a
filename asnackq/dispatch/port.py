"""What a delivery coroutine sees of its run: tickets in, what it saw out, its leases read only.

Rules of this module:

* A coroutine never sees the committer: it takes tickets through a ``Port``, reads whether
  the run still keeps a lease, waits at the breaker's gate, and passes values back - a
  ``Report`` of each pass of its send loop (the request, re-send, overload and breaker
  sample it saw), a ``Sent`` for each ticket.  Only the committer applies them: the run's
  counts and its breaker change nowhere else.
* The run's state reaches a coroutine through read-only views (``Leases``, ``Admission``):
  no method of theirs changes what the committer decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from asnackq.core import worker as w
from asnackq.dispatch.gate import Gate
from asnackq.dispatch.settings import Settings
from asnackq.dispatch.tickets import Claimed, Report, Sent

__all__ = ["LATE_S", "LATE_SLOTS", "Admission", "Leases", "Port"]

# A send more than this late for its slot takes a new one: at most LATE_S, or LATE_SLOTS
# slots' worth if longer, of sends ever go out late at once.
LATE_S = 0.02
LATE_SLOTS = 2


class Leases(Protocol):
    """Which leases the run keeps, read only (the committer's ``Ledger``)."""

    def keeps(self, ticket: w.Ticket, now: int) -> bool: ...

    def lease_until(self, ticket: w.Ticket) -> int | None: ...


class Admission(Protocol):
    """The breaker's gate, as a coroutine waits at it (the committer's ``Breaker``)."""

    @property
    def is_open(self) -> bool: ...

    async def admit(self, within_s: float) -> bool | None: ...


@dataclass(frozen=True, kw_only=True)
class Port:
    """A delivery coroutine's narrow view of its run: channels in, read-only views."""

    take: Callable[[], Awaitable[Claimed | None]]  # the next ticket; None: no more
    again: Callable[[], Awaitable[float | None]]  # a new send slot (None: the run ended)
    hand_back: Callable[[Sent], None]  # a ticket's result (``Sent.fatal``: the run fails)
    report: Report  # what one pass of the send loop saw
    leases: Leases
    now: Callable[[], int]  # the run's clock (``RunClock.read``)
    breaker: Admission
    settings: Settings
    gate: Gate | None = None  # concurrency "auto": the slots a coroutine takes

    def keeps(self, ticket: w.Ticket) -> bool:
        """Whether the run still holds this lease now (a send may go under it)."""
        return self.leases.keeps(ticket, self.now())

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
        until = self.leases.lease_until(ticket)
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
