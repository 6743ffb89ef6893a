"""Read-only openers: a queue or sink DB read without creating, locking or changing it.

A file is opened through a SQLite URI with ``mode=ro``: inspecting never creates a file,
takes a write lock or changes a byte; a ``postgresql://`` URL is read in read-only
transactions (``sessions.pg_read_only``).

Reads are plans (``asnackq.store.reads``): the sync commands run them on these readers;
async code opens a file with ``aread_only`` (aiosqlite, its own thread) and runs them with
``sqlite_aio.steps`` - one set of queries for both.
"""

from __future__ import annotations

import contextlib
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from asnackq.core import worker as w
from asnackq.core.inbox import SINK_SCHEMA, SINK_TABLE, SINK_TABLES
from asnackq.store import sessions
from asnackq.store.files import Locked, locked
from asnackq.store.sessions import Reader
from asnackq.store.targets import Target, is_url

if TYPE_CHECKING:
    import aiosqlite

__all__ = ["aread_only", "hint", "local_copies", "read_only"]

SQL_HAS_TABLE = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"


def hint(error: sqlite3.Error) -> str:
    """What a read-only reader can say about an error it cannot fix itself."""
    if error.sqlite_errorname == "SQLITE_READONLY_ROLLBACK":
        return (
            " (a writer died mid-transaction: its journal is rolled back by the next "
            "writer that opens the file)"
        )
    return ""


@contextlib.contextmanager
def read_only(
    path: Target, table: str, what: str = "queue", busy_s: float = 5.0
) -> Iterator[Reader]:
    """A read-only connection to an existing DB holding ``table``; ``ValueError`` otherwise.

    ``what`` names the file in messages: ``no WHAT at PATH``, ``PATH is not a WHAT``; a
    file locked by a writer for over ``busy_s`` raises ``Locked``.
    """
    if is_url(path):
        with sessions.pg_read_only(str(path), table, what) as reader:
            yield reader
        return
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no {what} at {path}")
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=busy_s)
    try:
        try:
            found = con.execute(SQL_HAS_TABLE, (table,)).fetchone()
        except sqlite3.DatabaseError as error:
            raise unreadable(path, what, error) from None
        if found is None:
            raise not_holding(path, what, table)
        yield con
    finally:
        con.close()


@contextlib.asynccontextmanager
async def aread_only(
    path: str | Path, table: str, what: str = "queue", busy_s: float = 5.0
) -> AsyncIterator[aiosqlite.Connection]:
    """``read_only`` for a file in async code: an aiosqlite connection (``mode=ro``)."""
    # (not on the command line's path: ``asnackq --help`` stays light)
    from asnackq.store.sqlite_aio import connected

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no {what} at {path}")
    uri = f"{path.resolve().as_uri()}?mode=ro"
    async with connected(uri, uri=True, timeout=busy_s) as con:
        try:
            found = await con.execute_fetchall(SQL_HAS_TABLE, (table,))
        except sqlite3.DatabaseError as error:
            raise unreadable(path, what, error) from None
        if not found:
            raise not_holding(path, what, table)
        yield con


def unreadable(path: Path, what: str, error: sqlite3.DatabaseError) -> ValueError:
    """The one line for a file that could not be read: ``Locked`` for a writer's lock."""
    if isinstance(error, sqlite3.OperationalError):
        why = Locked if locked(error) else ValueError
        return why(f"cannot read {path} now: {error}{hint(error)}")
    return ValueError(f"{path} is not a {what.removesuffix(' DB')} DB: {error}")


def not_holding(path: Path, what: str, table: str) -> ValueError:
    return ValueError(f"{path} is not a {what.removesuffix(' DB')} DB (no {table} table)")


@contextlib.contextmanager
def local_copies(queue: Target, sink: Target) -> Iterator[tuple[Path, Path]]:
    """Temporary SQLite copies of a queue's jobs and a sink's inbox and stock.

    The audit joins the two with SQLite's ATTACH; when either lives in PostgreSQL (or both,
    in different databases) it runs, unchanged, on these copies.
    """
    with tempfile.TemporaryDirectory(prefix="asnackq-audit-") as tmp:
        copies = Path(tmp) / "queue.db", Path(tmp) / "sink.db"
        for (source, table, what), target, schema in zip(
            [(queue, "jobs", "queue"), (sink, SINK_TABLE, "sink DB")],
            copies,
            [w.SCHEMA, SINK_SCHEMA],
            strict=True,
        ):
            copy = w.open_db(target, schema)
            try:
                with read_only(source, table, what) as con:
                    for name in SINK_TABLES if table == SINK_TABLE else (table,):
                        _copy(con, copy, name)
            finally:
                copy.close()
        yield copies


def _copy(source: Reader, copy: sqlite3.Connection, table: str) -> None:
    rows = [tuple(row) for row in source.execute(f"SELECT * FROM {table}")]
    if rows:
        marks = ",".join("?" * len(rows[0]))
        copy.execute("BEGIN IMMEDIATE")
        copy.execute(f"DELETE FROM {table}")
        copy.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        copy.execute("COMMIT")
