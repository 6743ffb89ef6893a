"""Where plans run: the ``Store`` face every driver's session shows, and ``open_store``, which
opens a queue file (aiosqlite: ``asnackq.store.sqlite_aio``) or a ``postgresql://`` URL
(psycopg: ``asnackq.store.pg_session``) behind it."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Protocol

from asnackq.core import worker as w
from asnackq.store import files
from asnackq.store.sqlite_aio import SqliteStore, call_fault, connected, steps
from asnackq.store.targets import is_url

__all__ = ["Store", "open_store"]


class Store(Protocol):
    """Where plans run: one session, driven by one task at a time."""

    @property
    def in_transaction(self) -> bool: ...

    async def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        """Run ``make()``'s plan in one transaction; ``make()`` again if it must be retried."""

    async def read(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]: ...

    async def close(self) -> None: ...


async def open_store(
    target: Any,
    schema: tuple[str, ...],
    busy_s: float = 1.0,
    attempts: int = 8,
    pragmas: tuple[str, ...] = w.PRAGMAS,
    closing: tuple[str, ...] = (),
    resolve_s: float = 300.0,
) -> Store:
    """A DB file (with ``pragmas``; ``closing`` tried before it is closed) or a
    ``postgresql://`` URL, with ``schema`` (the core's tuple) in place (``resolve_s``: how
    long a URL's store seeks the outcome of a COMMIT whose answer was lost)."""
    if is_url(target):
        from asnackq.store import pg_session

        return await pg_session.AsyncStore.open(target, schema, attempts, call_fault, resolve_s)
    await holds(Path(target), schema)  # never another application's file
    return await SqliteStore.open(target, schema, busy_s, attempts, pragmas, closing)


async def holds(path: Path, schema: tuple[str, ...]) -> bool:
    """``files.holds``, its tables read through aiosqlite."""
    if not files.present(path) or files.empty(path):
        return False
    for n, uri in enumerate(files.uris(path)):
        try:
            async with connected(uri, uri=True, timeout=5) as con:
                found, _ = await steps(con, files.plan_columns(), None)
            return files.judged(path, schema, found)
        except sqlite3.DatabaseError as error:
            files.unreadable(path, error, first=n == 0)
    raise AssertionError("unreachable")  # (the second URI's failure raised)
