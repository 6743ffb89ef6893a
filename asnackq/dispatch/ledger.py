"""The leases a run holds: which tickets, until when, and which are due for extension.

Rules of this module:

* Each held job has exactly one current lease (its ticket, with its token).  A ticket
  under any other token is not held (``holds``): it was lost, or its result was settled.
* A held lease is due for extension once half a lease or less is left, unless it ends at
  its job's deadline (``capped``): no extension can move it further.
* A lease whose result is waiting for its finish is never extended: its finish is pressing
  instead (it must not wait for a gathering).
* No I/O and no event loop: readings of the run's clock come in as arguments.
"""

from __future__ import annotations

from typing import NamedTuple

from asnackq.core import worker as w

__all__ = ["Due", "Ledger"]


class Due(NamedTuple):
    """What the held leases ask of the next cycle."""

    tickets: list[w.Ticket]  # leases ending within half a lease: to extend now
    wake_ms: int | None  # ms until the next one will (None: none will)
    pressing: bool  # a result waiting for its finish holds such a lease


class Ledger:
    """The current lease of each ticket the run holds."""

    def __init__(self, lease_ms: int) -> None:
        self.lease_ms = lease_ms
        self._held: dict[str, w.Ticket] = {}  # job id -> its current lease
        self._capped: set[str] = set()  # held leases that end at their deadline

    def __bool__(self) -> bool:
        return bool(self._held)

    def holds(self, ticket: w.Ticket) -> bool:
        """Whether this ticket is the current lease of a held job."""
        current = self._held.get(ticket["id"])
        return current is not None and current["token"] == ticket["token"]

    def held(self, ticket: w.Ticket) -> w.Ticket | None:
        """The held job's current lease if this ticket is it (extensions move
        ``lease_until``, not the token); None if the job is not held under this token."""
        current = self._held.get(ticket["id"])
        return current if current is not None and current["token"] == ticket["token"] else None

    def lease_until(self, ticket: w.Ticket) -> int | None:
        """When the run's lease on this ticket ends (None: not held)."""
        return int(self._held[ticket["id"]]["lease_until"]) if self.holds(ticket) else None

    def keeps(self, ticket: w.Ticket, now: int) -> bool:
        """Whether the run still holds this lease at ``now`` (a send may go under it)."""
        return self.holds(ticket) and now < self._held[ticket["id"]]["lease_until"]

    def hold(self, tickets: list[w.Ticket]) -> None:
        """Hold freshly claimed tickets."""
        self._held.update((ticket["id"], ticket) for ticket in tickets)

    def release(self, job_id: str) -> None:
        """Let go of a job: settled, lost, or left to its lease."""
        self._held.pop(job_id, None)
        self._capped.discard(job_id)

    def settled(self, tickets: list[w.Ticket]) -> None:
        """Let go of the jobs of finishes that committed (``release`` each)."""
        held, capped = self._held, self._capped
        for ticket in tickets:
            held.pop(ticket["id"], None)
        if capped:
            capped.difference_update(ticket["id"] for ticket in tickets)

    def due(self, now: int, returning: set[str]) -> Due:
        """The leases to extend at ``now``; ``returning``: the ids of results waiting for
        their finish."""
        half = self.lease_ms // 2
        due, wake, pressing = [], None, False
        for job_id, ticket in self._held.items():
            left = ticket["lease_until"] - now - half
            if job_id in returning:
                pressing = pressing or left <= 0
            elif job_id in self._capped:
                continue
            elif left <= 0:
                due.append(ticket)
            elif wake is None or left < wake:
                wake = left
        return Due(due, wake, pressing)

    def kept(self, now: int, due: list[w.Ticket], extended: list[w.Ticket | bool]) -> int:
        """Take a cycle's extensions of ``due``; returns how many came back stale (lost:
        someone else may hold them now, so they are never finished)."""
        lost = 0
        for old, new in zip(due, extended, strict=True):
            if new is False:
                self.release(old["id"])
                lost += 1
                continue
            assert isinstance(new, dict)
            self._held[old["id"]] = new
            if new["lease_until"] < now + self.lease_ms:
                self._capped.add(old["id"])  # at its deadline: no longer to extend
        return lost
