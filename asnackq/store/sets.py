"""A core statement run for many rows as one set statement, for the drivers that have one.

A plan's ``SqlMany`` is one statement per row (``executemany``): a fenced write, or an
insert.  Where a driver has a set text for it, the rows travel as one JSON array and the
database plans and runs one statement: the same fence and the same new values (or the same
rows inserted, in order), row for row.  An update's set naming one job twice runs row by
row (one UPDATE changes a row once); so does a set of one row (its own statement costs
less than reading an array of one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any, NamedTuple

from asnackq.core import worker as w

__all__ = ["SETTLE_FIELDS", "SetText", "as_set", "settle_set"]


class SetText(NamedTuple):
    """A set statement for a core statement, and how its rows travel."""

    text: str  # the statement; its one parameter is the rows' JSON array
    job: Callable[[Any], Any] | None  # a row's job (None: an insert, a job may recur)
    shape: Callable[[Any], Any] | None  # a row as the array holds it (None: as it is)


# A settle's row (``worker.SQL_SETTLE``'s named parameters) travels as an array of its
# values in this order, not as an object: half the JSON to write and to parse.
SETTLE_FIELDS = (
    "id",
    "token",
    "owner",
    "attempt",
    "lease_until",
    "status",
    "reason",
    "available_at",
    "new_owner",
    "new_lease_until",
)


def settle_set(text: str) -> SetText:
    """A driver's set statement for ``worker.SQL_SETTLE``: one row per job, as arrays in
    ``SETTLE_FIELDS``' order."""
    return SetText(text, itemgetter("id"), itemgetter(*SETTLE_FIELDS))


def as_set(
    sets: Mapping[str, SetText], sql: str, params: list[Any]
) -> tuple[str, tuple[str]] | None:
    """The one set statement of ``sets`` (and its JSON parameter) that runs ``sql`` for
    every row of ``params``, where there is one, for more than one row (of an update, each
    of another job); else None (``executemany``)."""
    found = sets.get(sql)
    if found is None or len(params) < 2:
        return None
    if found.job is not None and len({found.job(row) for row in params}) < len(params):
        return None
    rows = params if found.shape is None else map(found.shape, params)
    return found.text, (w.json_set(rows),)
