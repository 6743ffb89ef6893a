"""The purge of finished jobs past a horizon, batch by batch (``asnackq.store.retention``)."""

from __future__ import annotations

from functools import partial

from asnackq.store import retention, sessions
from asnackq.store.targets import Target, is_url

__all__ = ["purge"]

BATCH = 1000  # jobs a transaction, by default: each transaction short, whatever the backlog


def purge(
    path: Target, cutoff_ms: int, statuses: tuple[str, ...], now_ms: int, limit: int = BATCH
) -> dict[str, int]:
    """Purge the jobs of each of ``statuses`` that ended at or before ``cutoff_ms``, one
    audited batch a transaction, until none is left: how many, by status."""
    for status in statuses:
        retention.check_purge(cutoff_ms, status, limit)  # validate before any change
    purged = dict.fromkeys(statuses, 0)
    with sessions.open_session(path) as store:
        store.run(retention.plan_create)
        make = partial(retention.plan_purge, on_sqlite=not is_url(path), at_ms=now_ms)
        for status in statuses:
            batch = retention.Batch(limit, 0)
            while batch.jobs == limit:
                batch = store.run(partial(make, cutoff_ms, status, limit, after=batch.last_seq))
                purged[status] += batch.jobs
    return purged
