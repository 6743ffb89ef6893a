"""The sink's inbox: each event's effect applied once, however often it arrives.

Rules of this module:

* The inbox row and the effect (stock += qty) are written in one transaction.  The same
  id and qty again is a ``duplicate`` (no effect); another qty is a ``conflict`` (nothing
  changes).
* Group commit: one writer task takes every delivery waiting at that moment and decides
  them in arrival order inside one transaction (``plan_inbox``, run by the store's driver)
  - exactly as if they had come one by one.  A failed batch fails each of its deliveries
  (``SinkUnavailable``) and changes nothing - unless its COMMIT's answer was lost and the
  outcome could not be learned at once (``CommitUnknown``): the batch may then have
  committed, and a delivery sent again finds its id applied (a duplicate, no effect).
* One connection and one lock: a read never sees the writer's open transaction.  The DB
  is a file (WAL mode, through aiosqlite) or a ``postgresql://`` URL shared by replicas
  (``pg_sink``), whose lost session is opened again (``asnackq.store.pg_session.AsyncStore``;
  a sink never waits for the server: while it is away every batch fails at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from asnackq.core.inbox import SINK_SCHEMA, plan_inbox
from asnackq.core.worker import epoch_ms
from asnackq.store.opening import Store, open_store
from asnackq.store.outage import HEALTH_FIELDS, Health
from asnackq.store.targets import one_line

__all__ = ["LOG", "InboxWriter", "SinkUnavailable", "open_sink_db"]

LOG = logging.getLogger("asnackq.sink")  # the sink's log: one line each (``sink_server``)

# The inbox file is the sink's own (the contract's rollback journal is the queue's): a
# write-ahead log, synced at every COMMIT, is as durable and syncs once per commit, not
# twice; readers (audit, lab, dashboard) never wait for the writer.  The last sink to close
# the file returns it to the rollback journal: a stopped sink leaves one plain file, which a
# read-only reader reads without creating a -wal or -shm (nor write access to the directory).
SINK_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL")
SINK_CLOSING = ("PRAGMA busy_timeout = 0", "PRAGMA journal_mode=DELETE")  # busy: not the last


@dataclass
class Delivery:
    event_id: str
    qty: int
    token: int | None
    done: asyncio.Future[str]


async def open_sink_db(path: Path | str) -> Store:
    """Open (creating if needed) a sink DB: a file in WAL mode synced at every commit, or a URL."""
    return await open_store(
        path, SINK_SCHEMA, busy_s=5, pragmas=SINK_PRAGMAS, closing=SINK_CLOSING, resolve_s=0
    )


class InboxWriter:
    """The single writer: batches waiting deliveries into one transaction each."""

    def __init__(self, db: Store, batch_max: int) -> None:
        self.db = db
        self.lock = asyncio.Lock()  # one transaction at a time on this connection
        self.batch_max = batch_max
        self.waiting: asyncio.Queue[Delivery | None] = asyncio.Queue()
        self.commits = 0
        self.failing: float | None = None  # since when batches fail (monotonic seconds)

    async def submit(self, event_id: str, qty: int, token: int | None) -> str:
        """Queue a delivery and wait for its committed decision."""
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting.put_nowait(Delivery(event_id, qty, token, done))
        return await done  # (a cancelled request's decision still commits)

    async def run(self) -> None:
        """Commit batches until a ``None`` arrives, then return (after the last batch)."""
        while True:
            first = await self.waiting.get()
            batch = [first]
            while len(batch) < self.batch_max and not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            deliveries = [item for item in batch if item is not None]
            if deliveries:
                await self._settle(deliveries)
            if None in batch:
                return

    async def _settle(self, batch: list[Delivery]) -> None:
        try:
            async with self.lock:
                statuses = await self._commit(batch)
        except Exception as error:
            if self.failing is None:  # one line when batches begin to fail, one when they end
                self.failing = time.monotonic()
                LOG.warning(
                    "the inbox cannot commit (503 until it can): %s",
                    one_line(error),
                    extra={"event": "db_down"},
                )
            for item in batch:
                if not item.done.done():
                    item.done.set_exception(SinkUnavailable(str(error)))
            return
        if self.failing is not None:
            down_s = time.monotonic() - self.failing
            LOG.warning("the inbox commits again, after %.1f s", down_s, extra={"event": "db_back"})
            self.failing = None
        for item, status in zip(batch, statuses, strict=True):
            if not item.done.done():
                item.done.set_result(status)

    async def _commit(self, batch: list[Delivery]) -> list[str]:
        make = partial(plan_inbox, [(i.event_id, i.qty, i.token) for i in batch], epoch_ms())
        statuses: list[str] = await self.db.run(make)
        self.commits += 1
        return statuses

    def health(self) -> dict[str, int]:
        """The DB's outage counters (``asnackq.store.outage``; zeros for a file)."""
        health: Health | None = getattr(self.db, "health", None)
        return dict.fromkeys(HEALTH_FIELDS, 0) if health is None else health.counts()

    @property
    def db_down(self) -> bool:
        health: Health | None = getattr(self.db, "health", None)
        return health is not None and health.down

    async def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """A read outside any writer transaction."""
        async with self.lock:
            return await self.db.read(sql, params)


class SinkUnavailable(Exception):
    """Raised to a request whose batch failed to commit (answered as 503)."""
