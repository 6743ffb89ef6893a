"""Read-only openers: a queue or sink DB read without creating, locking or changing it.

A file is opened through a SQLite URI with ``mode=ro``: inspecting never creates a file,
takes a write lock or changes a byte; a ``postgresql://`` URL is read in read-only
transactions (``sessions.pg_read_only``).
"""

from __future__ import annotations

import contextlib
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

from asnackq.core import worker as w
from asnackq.core.inbox import SINK_SCHEMA
from asnackq.store import sessions
from asnackq.store.sessions import Reader
from asnackq.store.targets import Target, is_url

__all__ = ["Locked", "hint", "local_copies", "locked", "read_only"]


def hint(error: sqlite3.Error) -> str:
    """What a read-only reader can say about an error it cannot fix itself."""
    if error.sqlite_errorname == "SQLITE_READONLY_ROLLBACK":
        return (
            " (a writer died mid-transaction: its journal is rolled back by the next "
            "writer that opens the file)"
        )
    return ""


class Locked(ValueError):
    """Raised when a file stayed locked by a writer for longer than the reader would wait."""


def locked(error: BaseException) -> bool:
    """Whether ``error`` is SQLite saying that another connection holds the file."""
    return isinstance(error, Locked) or (
        isinstance(error, sqlite3.OperationalError)
        and error.sqlite_errorname in ("SQLITE_BUSY", "SQLITE_LOCKED")
    )


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
    kind = what.removesuffix(" DB")  # "sink DB" -> "is not a sink DB"
    try:
        try:
            found = con.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
            ).fetchone()
        except sqlite3.OperationalError as error:
            why = Locked if locked(error) else ValueError
            raise why(f"cannot read {path} now: {error}{hint(error)}") from None
        except sqlite3.DatabaseError as error:
            raise ValueError(f"{path} is not a {kind} DB: {error}") from None
        if found is None:
            raise ValueError(f"{path} is not a {kind} DB (no {table} table)")
        yield con
    finally:
        con.close()


@contextlib.contextmanager
def local_copies(queue: Target, sink: Target) -> Iterator[tuple[Path, Path]]:
    """Temporary SQLite copies of a queue's jobs and a sink's inbox and stock.

    The audit joins the two with SQLite's ATTACH; when either lives in PostgreSQL (or both,
    in different databases) it runs, unchanged, on these copies.
    """
    with tempfile.TemporaryDirectory(prefix="asnackq-audit-") as tmp:
        copies = Path(tmp) / "queue.db", Path(tmp) / "sink.db"
        for (source, table, what), target, schema in zip(
            [(queue, "jobs", "queue"), (sink, "inbox", "sink DB")],
            copies,
            [w.SCHEMA, SINK_SCHEMA],
            strict=True,
        ):
            copy = w.open_db(target, schema)
            try:
                with read_only(source, table, what) as con:
                    for name in (table, "stock") if table == "inbox" else (table,):
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
