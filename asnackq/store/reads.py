"""Read plans: a read is a ``w.Plan`` of ``w.Sql`` steps (``changed`` always False), so one
set of queries serves the sync commands and async code alike.

Rules of this module:

* A read plan asks for rows with ``rows = yield from fetch(SQL, params)`` and returns
  ``(result, False)``; it never writes.
* ``run`` drives one on a sync reader (sqlite3, or ``sessions.PgDatabase``), a statement a
  step and no transaction of its own; async code drives it on an aiosqlite connection
  with ``sqlite_aio.steps``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol, TypeVar

from asnackq.core import worker as w

__all__ = ["Rows", "fetch", "run"]

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


class Executes(Protocol):
    """A sync reader: ``execute`` returning a cursor (``fetchall``)."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...


def fetch(sql: str, params: Any = ()) -> Generator[w.Step, w.Reply, Rows]:
    """A read plan's step: ``rows = yield from fetch(SQL, params)``."""
    rows = yield w.Sql(sql, params)
    return rows or []


SQL_HAS_TABLE_SQLITE = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?"
SQL_HAS_TABLE_PG = "SELECT count(*) FROM (SELECT to_regclass(?) AS t) AS r WHERE t IS NOT NULL"


def has_table(name: str, on_sqlite: bool) -> w.Plan[bool]:
    """Whether the database holds the table ``name`` (a product's table may be absent)."""
    ((tables,),) = yield from fetch(
        SQL_HAS_TABLE_SQLITE if on_sqlite else SQL_HAS_TABLE_PG, (name,)
    )
    return bool(tables), False


def run(con: Executes, plan: w.Plan[T]) -> T:
    """A read plan's result on a sync reader."""
    reply: w.Reply = None
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value[0]  # type: ignore[no-any-return]
        if not isinstance(step, w.Sql):
            raise TypeError(f"a read plan yields statements only: {step!r}")
        reply = con.execute(step.sql, step.params).fetchall()
