"""The dashboard's watcher: what it reads, when, and how a locked or missing DB shows.

Rules of this module:

* Read-only.  Each sample opens the DBs read-only and closes them: a file through aiosqlite
  (``readers.aread_only``, a ``mode=ro`` URI), a ``postgresql://`` URL in read-only
  transactions in a thread (``readers.read_only``); every read is a plan of ``ops`` or
  ``ops.inspect``, the same as the commands run.  Nothing here
  writes, creates or migrates anything.  The numbers are ``ops.stats`` and ``ops.audit``,
  the same as ``asnackq stats`` and ``asnackq audit``.  A URL is shown with its password
  as ``***``.
* One task reads the DBs every ``SAMPLE_S``, or ten times the last sample's
  reading time when that is longer, never more than ``MAX_GAP_S`` apart; it keeps the last
  minute of done counts for the throughput.  Requests are answered from the latest sample,
  so open pages add no load on the queue.  The audit (a join over every job) runs at most
  every ten times its duration, at least every ``MAX_AUDIT_GAP_S``; so does the count of
  done jobs per minute over the last hour (``ops.inspect.done_per_minute``).
* One job's story (``Watcher.look_up``) is read when asked, not sampled.
* A file locked by a writer is not waited on inside SQLite: the read is retried for
  ``LOCK_WAIT_S``, then the page says so (the last figures stay, marked) and the next
  try comes after ``SAMPLE_S``.  A wait for a lock never counts as reading time.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from asnackq import ops
from asnackq.core import worker as w
from asnackq.core.inbox import SINK_TABLE
from asnackq.ops import inspect, queries
from asnackq.store import files, readers, reads
from asnackq.store.outage import database_error
from asnackq.store.reads import fetch
from asnackq.store.sqlite_aio import steps
from asnackq.store.targets import Target, is_url, one_line, scrubbed, shown

__all__ = ["AUDIT_LISTED", "Watcher", "attempt", "reading"]

SAMPLE_S = 1.0
MAX_GAP_S = 5.0  # the longest pause between samples, however long a read takes
MAX_AUDIT_GAP_S = 60.0  # the longest pause between audits (and hourly counts)
LOCK_WAIT_S = 1.0  # a writer's lock held longer than this shows as an error
LOCK_POLL_S = 0.02
WINDOW_MS = 60_000  # throughput over the last minute
REDRIVES_SHOWN = 10
AUDIT_LISTED = 20
SQL_LATEST_REDRIVES = "SELECT id, token, at_ms, note FROM redrives ORDER BY seq DESC LIMIT ?"
SQL_INBOX = """SELECT (SELECT count(*) FROM asnackq_webhook_inbox),
  (SELECT coalesce(sum(deliveries), 0) FROM asnackq_webhook_inbox),
  (SELECT coalesce(max(total), 0) FROM stock)"""


Reading = Callable[[], Awaitable[Any]]  # one try of a read


async def attempt(what: str, where: Target, read: Reading) -> tuple[Any, float]:
    """``await read()`` and the seconds it took, retried while a writer holds the file.

    A lock is waited out by retrying (for ``LOCK_WAIT_S`` at most; then ``files.Locked``), not
    inside SQLite's busy handler: the time returned is that of the read that succeeded, so a
    wait for a writer is never taken for the cost of reading.  Anything unreadable is a
    ``ValueError`` (one line; a URL's password never shown).
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        started = time.monotonic()
        try:
            return await read(), time.monotonic() - started
        except Exception as error:
            if files.locked(error):
                if time.monotonic() < deadline:
                    await asyncio.sleep(LOCK_POLL_S)
                    continue
                raise files.Locked(
                    f"the {what} {shown(where)} is locked by another process (held over "
                    f"{LOCK_WAIT_S:g} s): the figures shown are older"
                ) from None
            if isinstance(error, ValueError):
                raise
            if isinstance(error, (TypeError, ArithmeticError)):  # a value of another type
                raise ValueError(
                    f"the {what} {shown(where)} holds a value of another type than its "
                    f"schema's ({one_line(error)}): asnackq audit names the row"
                ) from None
            if not (database_error(error) or isinstance(error, ConnectionError)):
                raise  # (a server away, or its session lost: ``pg.Unreachable``, below)
            why = scrubbed(one_line(error), str(where)) if is_url(where) else one_line(error)
            raise ValueError(f"cannot read the {what} {shown(where)}: {why}") from None


def reading(where: Target, table: str, what: str, make: w.Make) -> Reading:
    """One read-only session on ``where`` running the read plan ``make()``: a file through
    aiosqlite, without waiting on a lock; a URL in a thread (``readers.read_only``)."""
    if is_url(where):

        def read() -> Any:
            with readers.read_only(where, table, what, busy_s=0) as con:
                return reads.run(con, make())

        return partial(asyncio.to_thread, read)

    async def aread() -> Any:
        async with readers.aread_only(where, table, what, busy_s=0) as con:
            result, _ = await steps(con, make(), None)
            return result

    return aread


def read_queue(now_ms: int, on_sqlite: bool) -> w.Plan[dict[str, Any]]:
    redrives = [
        dict(zip(("id", "token", "at_ms", "note"), row, strict=True))
        for row in (yield from fetch(SQL_LATEST_REDRIVES, (REDRIVES_SHOWN,)))
    ]
    stats, _ = yield from queries.plan_stats(now_ms, on_sqlite)
    leases, _ = yield from inspect.leases(now_ms)
    return {"stats": stats, "redrives": redrives, "leases": leases}, False


def read_inbox() -> w.Plan[dict[str, int]]:
    ((rows, deliveries, stock),) = yield from fetch(SQL_INBOX)
    return {
        "effects_applied": rows,
        "deliveries": deliveries,
        "duplicates": deliveries - rows,
        "stock": stock,
    }, False


def audit_state(audited: ops.Audit, now_ms: int) -> dict[str, Any]:
    return {
        "at_ms": now_ms,
        "flags": audited.flags,
        "violations": audited.violations,
        "stages": audited.stages,
        "attention": audited.listed["attention"],
        "violating": audited.listed["violations"],
    }


@dataclass
class Watcher:
    """The latest reading of the DBs, and the done counts of the last minute."""

    queue: Target
    sink_db: Target | None = None
    state: dict[str, Any] = field(default_factory=dict)
    done: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    audit_due: float = 0.0
    hour_due: float = 0.0
    took: float = 0.0  # seconds the last sample spent reading (lock waits excluded)

    async def sample(self) -> None:
        """Read everything once; ``ValueError`` (``files.Locked`` for a lock) if a DB cannot be
        read, and then the last state stays."""
        now = w.epoch_ms()
        queue, took = await attempt(
            "queue",
            self.queue,
            reading(self.queue, "jobs", "queue", partial(read_queue, now, not is_url(self.queue))),
        )
        state = {
            "queue": shown(self.queue),
            "sink_db": self.sink_db and shown(self.sink_db),
            "at_ms": now,
            "error": None,
            **queue,
            "inbox": None,
            "audit": self.state.get("audit"),
            "hour": self.state.get("hour"),
        }
        if self.sink_db is not None:
            read = reading(self.sink_db, SINK_TABLE, "sink DB", read_inbox)
            state["inbox"], inbox_s = await attempt("sink DB", self.sink_db, read)
            took += inbox_s
            if time.monotonic() >= self.audit_due:
                audited, audit_s = await attempt("queue and sink DB", self.queue, self.audit(now))
                state["audit"] = audit_state(audited, now)
                self.audit_due = time.monotonic() + min(10 * audit_s, MAX_AUDIT_GAP_S)
        if time.monotonic() >= self.hour_due:
            read = reading(self.queue, "jobs", "queue", partial(inspect.done_per_minute, now))
            state["hour"], hour_s = await attempt("queue", self.queue, read)
            self.hour_due = time.monotonic() + min(max(SAMPLE_S, 10 * hour_s), MAX_AUDIT_GAP_S)
        state["throughput"] = self.throughput(now, state["stats"]["by_status"]["done"])
        self.state, self.took = state, took

    async def look_up(self, job_id: str) -> dict[str, Any] | None:
        """One job's story: its row, redrives and trace id from the queue (a delivery's event
        and endpoint) and, with a sink DB, its inbox record and the audit's verdict; an
        event's deliveries by endpoint when the id is an event's; ``None`` when neither DB
        knows it.
        ``ValueError`` for an id that is not one or a DB that cannot be read."""
        inspect.check_job_id(job_id)
        now = w.epoch_ms()
        on_sqlite = not is_url(self.queue)
        read = reading(
            self.queue, "jobs", "queue", partial(inspect.stories, job_id, now, on_sqlite)
        )
        (story, event), _ = await attempt("queue", self.queue, read)
        inbox = None
        if self.sink_db is not None:
            read = reading(
                self.sink_db, SINK_TABLE, "sink DB", partial(inspect.inbox_record, job_id)
            )
            inbox, _ = await attempt("sink DB", self.sink_db, read)
        if story is None and inbox is None and event is None:
            return None
        job = story and story["job"]
        return {
            "id": job_id,
            "at_ms": now,
            "job": job,
            "redrives": story["redrives"] if story else [],
            "attempts": story["attempts"] if story else [],
            "trace_id": story and story["trace_id"],
            "delivery": story and story["delivery"],
            "event": event and event["event"],
            "deliveries": event["deliveries"] if event else [],
            "sink_db": self.sink_db is not None,
            "inbox": inbox,
            "audit": None if self.sink_db is None else inspect.verdict(job, inbox, now),
        }

    def audit(self, now_ms: int) -> Reading:
        """The audit: on files through aiosqlite, the sink DB attached to the queue's
        connection; with a URL on either side, ``ops.audit`` (local copies) in a thread."""
        queue, sink_db = self.queue, self.sink_db
        assert sink_db is not None
        if is_url(queue) or is_url(sink_db):
            audit = partial(ops.audit, queue, sink_db, now_ms, limit=AUDIT_LISTED, busy_s=0)
            return partial(asyncio.to_thread, audit)

        async def aread() -> ops.Audit:
            async with (
                readers.aread_only(sink_db, SINK_TABLE, "sink DB", busy_s=0),
                readers.aread_only(queue, "jobs", busy_s=0) as con,
            ):
                plan = queries.plan_audit(Path(sink_db), now_ms, None, AUDIT_LISTED)
                audited, _ = await steps(con, plan, None)
                return audited

        return aread

    def throughput(self, now_ms: int, done: int) -> dict[str, Any]:
        """Done jobs per second over the last minute (``None`` until two samples)."""
        self.done.append((now_ms, done))
        while len(self.done) > 2 and self.done[1][0] <= now_ms - WINDOW_MS:
            self.done.popleft()
        first_ms, first = self.done[0]
        span_s = (now_ms - first_ms) / 1000
        # [seconds ago (negative), done/s] between consecutive samples: the sparkline.
        rates = [
            [round((b_ms - now_ms) / 1000, 1), round(max(0, b - a) * 1000 / (b_ms - a_ms), 1)]
            for (a_ms, a), (b_ms, b) in itertools.pairwise(self.done)
            if b_ms > a_ms
        ]
        return {
            "window_s": round(span_s, 1),
            "series": rates,
            "done_per_s": round(max(0, done - first) / span_s, 1) if span_s > 0 else None,
        }

    def pause(self) -> float:
        """Seconds until the next sample: ``SAMPLE_S``, or ten times the last sample's reading
        time when that is longer (a reader delays the writers' commits on a rollback journal:
        the dashboard reads at most a tenth of the time), never over ``MAX_GAP_S``."""
        return min(max(SAMPLE_S, 10 * self.took), MAX_GAP_S)

    async def run(self) -> None:
        """Sample until cancelled; a failed read shows as ``error`` over the last state, and
        the next try comes after ``SAMPLE_S`` (a lock or an error is no cost to scale by).
        Whatever a sample raises, sampling goes on: a dashboard never freezes on old figures
        while saying nothing (its text, not a URL's password: ``attempt``; an error of
        another kind by its type alone)."""
        while True:
            await asyncio.sleep(self.pause())
            try:
                await self.sample()
            except Exception as error:
                said = str(error) if isinstance(error, ValueError) else type(error).__name__
                self.state = {**self.state, "error": said, "at_ms": w.epoch_ms()}
                self.took = 0.0
