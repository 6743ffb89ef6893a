"""A COMMIT held in flight: a deferred constraint trigger on ``jobs`` sleeps a second at
COMMIT while the table ``slow`` has a row, so a test can cut the session right then."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.store import opening
from asnackq.store.pg_session import AsyncStore

from .conftest import T0
from .pgdb import query

SLOW_COMMIT = (
    "CREATE TABLE slow (one INTEGER)",
    """CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM slow) THEN PERFORM pg_sleep(1); END IF;
  RETURN NULL;
END $$""",
    """CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON jobs DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION slow_commit()""",
    "INSERT INTO slow VALUES (1)",
)


async def in_commit(url: str, pid: int) -> None:
    """Return once session ``pid`` is in a slow COMMIT (the trigger's sleep; bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = await asyncio.to_thread(
            query,
            url,
            "SELECT query, wait_event FROM pg_stat_activity WHERE pid = %s AND state = 'active'",
            (pid,),
        )
        if rows and rows[0] == ("COMMIT", "PgSleep"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the COMMIT was never seen in flight")


@contextlib.asynccontextmanager
async def slow_queue(url: str, now_ms: int = T0) -> AsyncIterator[tuple[AsyncQueue, AsyncStore]]:
    """A queue on ``url`` holding one pending job ``a`` (enqueued at ``now_ms``), whose
    COMMITs of an UPDATE are slow."""
    store = await opening.open_store(url, w.SCHEMA)
    assert isinstance(store, AsyncStore)
    queue = AsyncQueue(store)
    try:
        assert await queue.enqueue({"id": "a", "qty": 1}, now_ms, 60_000)
        for sql in SLOW_COMMIT:
            query(url, sql)
        yield queue, store
    finally:
        await queue.close()


def job_row(url: str) -> tuple[str, int]:
    """Job ``a``'s status and token."""
    status, token = query(url, "SELECT status, token FROM jobs WHERE id = 'a'")[0]
    return status, token
