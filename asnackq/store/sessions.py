"""Synchronous sessions on a queue or sink for the command line, ``ops`` and the lab.

Rules of this module:

* A target is a file (sqlite3, the core's own driver) or a ``postgresql://`` URL
  (``asnackq.store.pg.drive``); both give the same small face: ``run(make, fault)`` runs a
  plan in one transaction, ``execute(sql, params)`` reads with SQLite's placeholders.
* Nothing creates a queue but ``open_session(..., create=True)`` (``init``, the lab, the
  demo); every other opening insists the queue (or the sink DB) is already there, and
  inspecting opens read-only.  A file is written only if it is new, empty or already a
  queue (``asnackq.store.files``): never another application's database.
* A file another program holds (a reader's transaction, a writer's lock) is waited for, its
  turn taken as soon as the file is free, for ``BUSY_WAIT_S`` at most: the first wait is said
  once, as a record of the ``asnackq.store`` logger (the commands print it as one line); a
  transaction refused for the lock committed nothing, so it is simply run again.
* psycopg is imported only when a URL is used.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from asnackq.core import worker as w
from asnackq.store import files
from asnackq.store.files import Locked, locked
from asnackq.store.outage import Health
from asnackq.store.pg_sql import Missing
from asnackq.store.targets import Target, is_url, shown

__all__ = [
    "Reader",
    "Session",
    "init",
    "open_session",
    "pg_read_only",
    "require",
    "take_turn",
]

T = TypeVar("T")
LOG = logging.getLogger("asnackq.store")
BUSY_WAIT_S = 30.0  # how long a command waits its turn on a file another program holds

LOST_RUNS = 3  # how often a plan meets a lost session before its error is the caller's
RETURN_WAIT_S = 30.0  # how long a session lost mid-command waits for its server


class Reader(Protocol):
    """What the inspecting commands read through: ``execute`` with SQLite's placeholders."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...


class Session(Reader, Protocol):
    """A read-write session: plans, reads, and ``close``."""

    def run(self, make: w.Make, fault: w.Fault = None) -> Any: ...

    def close(self) -> None: ...


def take_turn(call: Callable[[], T], where: Target, wait_s: float = BUSY_WAIT_S) -> T:
    """``call()``, again while another connection holds the file ``where`` (each try waits
    in SQLite's busy handler first), for ``wait_s`` at most: then ``Locked``.  The first
    refusal is logged once.  ``call`` must change nothing when refused for the lock (a
    transaction rolled back, an opening closed)."""
    gives_up = None
    while True:
        try:
            return call()
        except (sqlite3.OperationalError, Locked) as error:
            if not locked(error):
                raise
            now = time.monotonic()
            if gives_up is None:
                gives_up = now + wait_s
                LOG.warning(
                    "waiting: %s is held by another program; its turn comes when it is "
                    "free (up to %g s)",
                    where,
                    wait_s,
                    extra={"event": "waiting", "fields": {"file": str(where), "wait_s": wait_s}},
                )
            if now >= gives_up:
                raise Locked(
                    f"{where} stayed held by another program for {wait_s:g} s: {error}"
                ) from None
        time.sleep(random.uniform(0.01, 0.1))  # (a refusal without the handler's wait)


class SqliteFile:
    """A queue file through the core's own sqlite3 driver; a plan refused for another
    program's lock is run again (``take_turn``)."""

    def __init__(self, con: sqlite3.Connection, where: Target) -> None:
        self.con, self.where = con, where

    def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        return take_turn(lambda: w.drive(self.con, make(), fault), self.where)

    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        return self.con.execute(sql, parameters)

    def close(self) -> None:
        self.con.close()


class PgDatabase:
    """A PostgreSQL database through ``asnackq.store.pg`` (reads bound client-side, like SQLite).

    A plan whose session was lost before its COMMIT was sent (a server restart, a killed
    session) committed nothing: it is made again and run on a new session, opened once
    the server answers (``RETURN_WAIT_S`` at most).  A COMMIT cut on its way is not re-run:
    its error is the caller's (the command's one line).
    """

    def __init__(self, con: Any, url: str | None = None) -> None:
        self.con, self.url = con, url  # (without ``url``: never opened again)

    def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        from asnackq.store import pg

        for attempt in range(LOST_RUNS):
            try:
                return pg.drive(self.con, make(), fault, make=make)
            except pg.SessionLost:
                if self.url is None or attempt == LOST_RUNS - 1:
                    raise
            self.con.close()
            pg.wait_until_reachable(self.url, RETURN_WAIT_S, lambda _: None)
            self.con = _pg(self.url, w.SCHEMA, create=False)
        raise AssertionError("unreachable")

    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        from asnackq.store import pg, pg_sql

        return pg.client_cursor(self.con).execute(pg_sql.placeholders(sql), parameters)

    def close(self) -> None:
        self.con.close()


def _pg(where: str, schema: tuple[str, ...], *, create: bool, read_only: bool = False) -> Any:
    """A session with ``schema`` checked (or created).  One that ends while it opens (a
    killed backend, a restart: an ``OperationalError`` once connected; its plan is made
    again, ``CREATE ... IF NOT EXISTS``) is opened again, for ``RETURN_WAIT_S`` at most;
    a server that cannot be reached is the caller's at once (``Unreachable``)."""
    import psycopg

    from asnackq.store import pg

    health, gives_up = Health(), time.monotonic() + RETURN_WAIT_S
    while True:
        try:
            return pg.connect(where, schema, create=create, read_only=read_only)
        except psycopg.OperationalError:
            wait = health.failed()
            if time.monotonic() + wait > gives_up:
                raise
        time.sleep(wait)


@contextlib.contextmanager
def open_session(where: Target, *, create: bool = False) -> Iterator[Session]:
    """A read-write session on a queue (created only with ``create``), closed on exit."""
    if is_url(where):
        store: Session = PgDatabase(_pg(str(where), w.SCHEMA, create=create), str(where))
    else:
        if not create:
            require(where)
        take_turn(lambda: files.holds(where, w.SCHEMA), where)  # never another application's
        store = SqliteFile(take_turn(lambda: w.open_queue(where), where), where)
    try:
        yield store
    finally:
        store.close()


def require(where: Target, what: str = "queue") -> None:
    """Insist the queue exists (``ValueError`` naming ``asnackq init`` otherwise)."""
    if is_url(where):
        try:
            _pg(str(where), w.SCHEMA, create=False).close()
        except Missing:
            raise ValueError(
                f"no {what} at {shown(where)} (create one with: asnackq init {shown(where)})"
            ) from None
    elif not take_turn(lambda: files.holds(where, w.SCHEMA), where):
        raise ValueError(f"no {what} at {where} (create one with: asnackq init {where})")


def init(where: Target) -> tuple[bool, int]:
    """Create a queue if absent: ``(created, jobs)``."""
    if is_url(where):
        try:
            require(where)
            created = False
        except ValueError:
            created = True
    else:
        created = not take_turn(lambda: files.holds(where, w.SCHEMA), where)
    with open_session(where, create=True) as store:
        (jobs,) = store.execute("SELECT count(*) FROM jobs").fetchone()
    return created, int(jobs)


@contextlib.contextmanager
def pg_read_only(where: str, table: str, what: str) -> Iterator[Reader]:
    """A read-only session on a database that holds ``table`` (``ValueError`` otherwise)."""
    schema = w.SCHEMA if table in ("jobs", "redrives") else _sink_schema()
    try:
        con = _pg(where, schema, create=False, read_only=True)
    except Missing:
        raise ValueError(f"no {what} at {shown(where)} (no {table} table)") from None
    try:
        yield PgDatabase(con)
    finally:
        con.close()


def _sink_schema() -> tuple[str, ...]:
    from asnackq.core.inbox import SINK_SCHEMA

    return SINK_SCHEMA
