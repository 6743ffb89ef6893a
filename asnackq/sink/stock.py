"""The sink's store and its effect (stock += qty, keyed on the event's id): one receiver of
the inbox, with the same rules, rows and group commit as every other (``core.inbox``,
``asnackq.sink.inbox``).

Rules of this module:

* An event's content is its canonical form (``core.inbox.event_digest``): the same id and
  qty again is a duplicate whatever the body's whitespace; another qty a conflict.
* The effect is statements (``core.inbox.plan_stock``: each applied event's move kept, the
  stock raised by their sum), yielded by the inbox plan after its rows: a batch's
  decisions, rows and effect are one plan on the store's driver (``Store.run`` on
  PostgreSQL; on a file ``effects.on_file``, whose BEGIN rides with the plan's first
  write).  Its failure is the batch's: 503 to each of its deliveries, nothing changed.
* One connection and one lock: a read never sees a batch's open transaction.  The DB is a
  file (WAL mode, through aiosqlite) or a ``postgresql://`` URL shared by replicas, whose
  lost session is opened again (``asnackq.store.pg_session.AsyncStore``; a sink never
  waits for the server: while it is away every batch fails at once).
* A DB that holds the inbox of an earlier sink (its ``inbox`` table: ids with their qty,
  before the sink became a receiver of the library's inbox) is refused, with one line
  naming what to do: its history is never silently left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from functools import partial
from pathlib import Path
from typing import Any

from asnackq.core.inbox import (
    SINK_SCHEMA,
    Arrival,
    event_digest,
    plan_receive,
    plan_stock,
)
from asnackq.core.worker import epoch_ms
from asnackq.sink.inbox import Delivery, GroupCommit
from asnackq.store import files
from asnackq.store.effects import on_file
from asnackq.store.opening import Store, open_store
from asnackq.store.outage import HEALTH_FIELDS, Health
from asnackq.store.pg_sql import SQL_EARLIER_SINK
from asnackq.store.sqlite_aio import SqliteStore, connected, steps
from asnackq.store.targets import is_url, shown

__all__ = ["EARLIER_INBOX", "StockInbox", "open_sink_db"]

# The inbox file is the sink's own (the contract's rollback journal is the queue's): a
# write-ahead log, synced at every COMMIT, is as durable and syncs once per commit, not
# twice; readers (audit, lab, dashboard) never wait for the writer.  The last sink to close
# the file returns it to the rollback journal: a stopped sink leaves one plain file, which a
# read-only reader reads without creating a -wal or -shm (nor write access to the directory).
SINK_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL")
SINK_CLOSING = ("PRAGMA busy_timeout = 0", "PRAGMA journal_mode=DELETE")  # busy: not the last
EARLIER_INBOX = (
    "{db} holds the inbox of an earlier asnackq sink (table inbox), which this sink does "
    "not read: audit it with the asnackq that wrote it, then give this sink a new --db"
)


async def open_sink_db(target: Path | str) -> Store:
    """Open (creating if needed) a sink DB: a file in WAL mode synced at every commit, or a
    URL; one that holds an earlier sink's inbox is refused (``ValueError``)."""
    if not is_url(target) and await _earlier_file(Path(target)):
        raise ValueError(EARLIER_INBOX.format(db=target))
    store = await open_store(
        target, SINK_SCHEMA, busy_s=5, pragmas=SINK_PRAGMAS, closing=SINK_CLOSING, resolve_s=0
    )
    if is_url(target) and (await store.read(SQL_EARLIER_SINK))[0][0]:
        await store.close()
        raise ValueError(EARLIER_INBOX.format(db=shown(str(target))))
    return store


async def _earlier_file(path: Path) -> bool:
    """Whether the file holds an earlier sink's ``inbox`` table (read-only; a file that
    cannot be read is left to ``open_store``'s refusals)."""
    try:
        if not files.present(path) or files.empty(path):
            return False
    except ValueError:  # not a file, or not SQLite: open_store refuses it, saying why
        return False
    with contextlib.suppress(sqlite3.Error, ValueError):
        async with connected(files.uris(path)[0], uri=True, timeout=5) as con:
            found, _ = await steps(con, files.plan_columns(), None)
        return "inbox" in found and "asnackq_webhook_inbox" not in found
    return False


class StockInbox:
    """The sink's deliveries, group-committed with the stock effect (the module's rules)."""

    def __init__(self, db: Store, batch_max: int) -> None:
        self.db = db
        self.lock = asyncio.Lock()  # one transaction at a time on this connection
        self.inbox = GroupCommit(self._run, batch_max)

    async def submit(self, event_id: str, qty: int, token: int | None) -> str:
        """Queue an event's delivery and wait for its committed decision."""
        return await self.inbox.submit(Arrival(event_id, event_digest(event_id, qty), token), qty)

    async def _run(self, batch: list[Delivery]) -> list[str]:
        def effect(applied: list[int]) -> Any:
            return plan_stock([(batch[i].arrival.event_id, batch[i].payload) for i in applied])

        make = partial(plan_receive, [d.arrival for d in batch], epoch_ms(), effect)
        async with self.lock:
            if isinstance(self.db, SqliteStore):
                return await on_file(self.db, make)
            statuses: list[str] = await self.db.run(make)
        return statuses

    @property
    def commits(self) -> int:
        return self.inbox.commits

    def health(self) -> dict[str, int]:
        """The DB's outage counters (``asnackq.store.outage``; zeros for a file)."""
        health: Health | None = getattr(self.db, "health", None)
        return dict.fromkeys(HEALTH_FIELDS, 0) if health is None else health.counts()

    @property
    def db_down(self) -> bool:
        health: Health | None = getattr(self.db, "health", None)
        return health is not None and health.down

    async def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """A read outside any batch's transaction."""
        async with self.lock:
            return await self.db.read(sql, params)

    async def close(self) -> None:
        """Answer every delivery in hand, then close the DB."""
        try:
            await self.inbox.close()
        finally:
            await self.db.close()
