"""Rows of a cycle's settle (``worker.SQL_SETTLE``'s parameters), for the set statements'
tests on each database."""

from __future__ import annotations

from typing import Any

from .conftest import T0

NOW = T0 + 1_000
# Ids that JSON must escape, or that read as numbers.
ODD_IDS = ['q"uote', "back\\slash", "tab\tnew\nline", "caf\u00e9 \u2603 \U0001f600", "1e3", "007"]


def settle(job: str, stale: bool) -> dict[str, Any]:
    """A settle's row finishing ``job`` done, its fence stale or not."""
    return {
        "id": job,
        "token": 2 if stale else 1,
        "owner": "o",
        "attempt": 1,
        "lease_until": NOW + 5,
        "status": "done",
        "reason": None,
        "available_at": None,
        "new_owner": None,
        "new_lease_until": None,
    }


def of_every_kind(jobs: list[str]) -> list[dict[str, Any]]:
    """A settle's rows for ``jobs`` (each leased by "o" until NOW + 5, attempt and token 1):
    finishes, retries, extensions and deaths in turn, every fourth fence stale."""
    rows = []
    for n, job in enumerate(jobs):
        row = settle(job, stale=n % 4 == 3)
        if n % 4 == 1:  # a retry
            row |= {"status": "pending", "reason": "5xx", "available_at": 2**62 + n}
        elif n % 4 == 2:  # an extension
            row |= {"status": "leased", "new_owner": "o", "new_lease_until": NOW + 9_000}
        elif n % 8 == 7:  # a death
            row |= {"status": "dead", "reason": "exhausted"}
        rows.append(row)
    return rows
