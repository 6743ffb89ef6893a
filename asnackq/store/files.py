"""Whether a file may hold asnackq's tables: a command that writes never converts a file
that belongs to someone else.

Rules of this module:

* A writer may create its tables only in a new or empty database (no file, a file of zero
  bytes, or a SQLite file without tables); it writes to a database that already holds
  those tables with exactly those columns (``schema``: the core's tuple, read by SQLite
  itself), other tables beside them included: an application's own database where its
  connection created the queue (``AsyncQueue.within``).
* Anything else is refused with one line and nothing written: a directory, a FIFO or any
  other non-file (never opened, so a FIFO cannot block), a file that is not SQLite, a
  database holding other tables (another application's, or the sink's inbox where a queue
  is wanted), or one whose tables have other columns.
* The check only reads (``mode=ro``), except that a journal left by a writer that died
  mid-transaction is rolled back first (as the next opener of any SQLite file must).
  PostgreSQL URLs are not files and are not checked here.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import stat
from pathlib import Path

__all__ = ["holds"]

HEADER = b"SQLite format 3\x00"
SQL_OBJECTS = (
    "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%'"
)
KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


@functools.cache
def tables(schema: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The tables ``schema`` creates, each with its column names (from an in-memory DB)."""
    con = sqlite3.connect(":memory:")
    try:
        for statement in schema:
            con.execute(statement)
        return columns(con)
    finally:
        con.close()


def columns(con: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    names = [name for (name,) in con.execute(SQL_OBJECTS)]
    return {
        name: tuple(row[1] for row in con.execute("SELECT * FROM pragma_table_info(?)", (name,)))
        for name in names
    }


def holds(path: str | os.PathLike[str], schema: tuple[str, ...]) -> bool:
    """True if ``path`` already holds ``schema``'s tables, False if it is absent or an empty
    database (where they may be created); ``ValueError`` (one line) for anything else."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        raise ValueError(f"cannot use {path}: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ValueError(f"{path} is {kind}, not a database file")
    found = existing(path)
    wanted = tables(schema)
    if not found:
        return False
    missing = [name for name in wanted if name not in found]
    others = sorted(found.keys() - wanted.keys())
    if missing and others:  # creating them would convert someone else's database
        raise ValueError(
            f"{path} holds other tables ({', '.join(others[:5])}): refusing to add "
            f"{', '.join(wanted)} to another database"
        )
    if missing:
        raise ValueError(
            f"{path} holds {', '.join(found)} but no {missing[0]} table: refusing to write "
            "to another database"
        )
    changed = [name for name in wanted if found[name] != wanted[name]]
    if changed:
        raise ValueError(f"{path}: table {changed[0]} has other columns than asnackq's")
    return True


def existing(path: Path) -> dict[str, tuple[str, ...]]:
    """The tables (and views) in the SQLite file ``path``, read-only."""
    try:
        with open(path, "rb") as file:
            header = file.read(len(HEADER))
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    if not header:
        return {}  # zero bytes: SQLite's empty database
    if header != HEADER:
        raise ValueError(f"{path} is not a SQLite database: refusing to write to it")
    try:
        return read_tables(f"{path.resolve().as_uri()}?mode=ro")
    except sqlite3.OperationalError as error:
        if error.sqlite_errorname != "SQLITE_READONLY_ROLLBACK":
            raise ValueError(f"cannot read {path} now: {error}") from None
    except sqlite3.DatabaseError as error:
        raise ValueError(f"cannot read {path} now: {error}") from None
    # A writer died mid-transaction: a reader cannot see past its journal.  Reading as a
    # writer rolls it back first, as the next opener of any SQLite file must.
    try:
        return read_tables(path.resolve().as_uri())
    except sqlite3.DatabaseError as error:
        raise ValueError(f"cannot read {path} now: {error}") from None


def read_tables(uri: str) -> dict[str, tuple[str, ...]]:
    con = sqlite3.connect(uri, uri=True, timeout=5)
    try:
        return columns(con)
    finally:
        con.close()
