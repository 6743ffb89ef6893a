"""What a run needs of its queue: the typed seam between the committer and ``AsyncQueue``.

Rules of this module:

* The committer, the slots and the spans reach the queue only through ``Queue``: the
  cycle plans (plain and paced), reads outside any write transaction, the shared rate's
  row, the store's health and how long a closing run waits for it.  ``asnackq.aio``'s
  ``AsyncQueue`` is the one implementation; this wing never imports it.
* Every claim is spelled out: owner, the clock reading, the lease, the claims for waiting
  coroutines and those ahead of demand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from asnackq.core import rate as r
from asnackq.core import worker as w
from asnackq.store.attempts import Record
from asnackq.store.outage import Health

__all__ = ["Queue"]


class Queue(Protocol):
    """The queue as a run's parts use it (``asnackq.aio.AsyncQueue``)."""

    @property
    def health(self) -> Health | None: ...

    def give_up_after(self, seconds: float) -> None: ...

    async def read(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> list[tuple[Any, ...]]: ...

    async def shared_rate(self) -> r.Rate | None: ...

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
    ) -> w.Cycle: ...

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
    ) -> r.Paced: ...

    async def keep_attempts(self) -> None: ...
