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

from asnackq.core import worker as w
from asnackq.store import reads

__all__ = [
    "Locked",
    "empty",
    "existing",
    "holds",
    "judged",
    "locked",
    "plan_columns",
    "present",
    "unreadable",
    "uris",
]

HEADER = b"SQLite format 3\x00"
SQL_OBJECTS = (
    "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%'"
)
KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


class Locked(ValueError):
    """Raised when a file stayed locked by another connection for longer than its reader or
    writer would wait."""


def locked(error: BaseException) -> bool:
    """Whether ``error`` is SQLite saying that another connection holds the file."""
    return isinstance(error, Locked) or (
        isinstance(error, sqlite3.OperationalError)
        and error.sqlite_errorname in ("SQLITE_BUSY", "SQLITE_LOCKED")
    )


@functools.cache
def tables(schema: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The tables ``schema`` creates, each with its column names (from an in-memory DB)."""
    con = sqlite3.connect(":memory:")
    try:
        for statement in schema:
            con.execute(statement)
        return reads.run(con, plan_columns())
    finally:
        con.close()


def plan_columns() -> w.Plan[dict[str, tuple[str, ...]]]:
    """The tables (and views) of a database, each with its column names: a read plan."""
    found = {}
    for (name,) in (yield from reads.fetch(SQL_OBJECTS)):
        rows = yield from reads.fetch("SELECT * FROM pragma_table_info(?)", (name,))
        found[name] = tuple(row[1] for row in rows)
    return found, False


def holds(path: str | os.PathLike[str], schema: tuple[str, ...]) -> bool:
    """True if ``path`` already holds ``schema``'s tables, False if it is absent or an empty
    database (where they may be created); ``ValueError`` (one line) for anything else."""
    path = Path(path)
    if not present(path) or empty(path):
        return False
    return judged(path, schema, existing(path))


def present(path: Path) -> bool:
    """Whether a file is at ``path`` (``ValueError`` for anything but a regular file)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        raise ValueError(f"cannot use {path}: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ValueError(f"{path} is {kind}, not a database file")
    return True


def empty(path: Path) -> bool:
    """Whether the file has zero bytes (SQLite's empty database); ``ValueError`` if it is
    not a SQLite file."""
    try:
        with open(path, "rb") as file:
            header = file.read(len(HEADER))
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    if header and header != HEADER:
        raise ValueError(f"{path} is not a SQLite database: refusing to write to it")
    return not header


def judged(path: Path, schema: tuple[str, ...], found: dict[str, tuple[str, ...]]) -> bool:
    """Whether ``found`` (the file's tables) are ``schema``'s: True; False for none at all;
    ``ValueError`` for another database's."""
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


def uris(path: Path) -> tuple[str, str]:
    """How the tables are read: read-only; then, if a writer died mid-transaction (a reader
    cannot see past its journal), as a writer, which rolls it back first - as the next
    opener of any SQLite file must."""
    return f"{path.resolve().as_uri()}?mode=ro", path.resolve().as_uri()


def unreadable(path: Path, error: sqlite3.DatabaseError, first: bool) -> None:
    """``ValueError`` for a failed read of the tables (``Locked`` for another connection's
    lock), unless the next URI may succeed."""
    rollback = isinstance(error, sqlite3.OperationalError) and (
        error.sqlite_errorname == "SQLITE_READONLY_ROLLBACK"
    )
    if not (first and rollback):
        why = Locked if locked(error) else ValueError
        raise why(f"cannot read {path} now: {error}") from None


def existing(path: Path) -> dict[str, tuple[str, ...]]:
    """The tables (and views) in the SQLite file ``path``."""
    for n, uri in enumerate(uris(path)):
        con = sqlite3.connect(uri, uri=True, timeout=5)
        try:
            return reads.run(con, plan_columns())
        except sqlite3.DatabaseError as error:
            unreadable(path, error, first=n == 0)
        finally:
            con.close()
    raise AssertionError("unreachable")  # (the second URI's failure raised)
