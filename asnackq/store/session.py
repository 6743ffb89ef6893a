"""A session beside a queue's connection, opened at its first transaction.

Rules of this module:

* A PostgreSQL queue runs its intakes on a session of their own (``asnackq.store.intakes``),
  so that their COMMITs run beside the Dispatcher's cycles instead of taking turns with them.
  The server orders concurrent transactions by its row locks, as for two workers.  A file
  has one writer: it has no such session.
* One transaction at a time on a session, under its lock; shielded: a cancelled caller
  waits for its transaction's COMMIT or ROLLBACK to land, then re-raises.
* A session that cannot be opened (the server away) is an outage, as a session lost is:
  ``StoreUnavailable``, nothing committed, with a backoff's ``retry_in_s``; until then every
  call fails at once, without trying (the store's rule for its reconnections, the same
  ``Health``).  Once open, the store's own reconnection rules apply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from asnackq.core import worker as w
from asnackq.store.joint import Underway
from asnackq.store.opening import Store
from asnackq.store.outage import Backoff, Health, StoreUnavailable
from asnackq.store.targets import one_line

__all__ = ["Opener", "Session"]

Opener = Callable[[], Awaitable[Store]]


class Session:
    """A session opened by ``opener`` at its first transaction, closed by ``close``."""

    def __init__(self, opener: Opener, backoff: Backoff | None = None) -> None:
        self._opener = opener
        self._store: Store | None = None
        self._lock = asyncio.Lock()
        self._opening = Health(backoff or Backoff())  # the backoff of failed openings
        self._why = ""  # why the last opening failed
        self._running = Underway()  # the transactions asked for (``close`` waits for them)

    async def run(self, make: w.Make) -> Any:
        """``make``'s plan in a transaction of its own on this session."""
        task = self._running.add(asyncio.ensure_future(self._locked(make)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])  # let COMMIT or ROLLBACK land, then re-raise
            raise

    async def _locked(self, make: w.Make) -> Any:
        async with self._lock:
            if self._store is None:
                if (wait := self._opening.wait_s()) > 0:
                    raise StoreUnavailable(f"{self._why} (next try in {wait * 1000:.0f} ms)", wait)
                try:
                    self._store = await self._opener()
                except StoreUnavailable:
                    raise
                except ConnectionError as error:  # (the server away, a login refused)
                    self._why = one_line(error)
                    raise StoreUnavailable(self._why, self._opening.failed()) from None
                self._opening.back()
            return await self._store.run(make)

    async def close(self) -> None:
        """Wait for the transactions asked for so far, then close the session."""
        await self._running.drained()
        async with self._lock:
            if self._store is not None:
                await self._store.close()
                self._store = None
