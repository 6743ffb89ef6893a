"""What an operator reads: stats, dead jobs, history, the evidence audit, the dashboard.

Rules of this wing:

* Everything only reads, through read-only openers (``asnackq.store.readers``); the two
  writes are audited: ``redrive_by_reason`` (the core's redrive, one job per transaction)
  and ``ops.purge`` (finished jobs past a horizon, ``asnackq.store.retention``).
* The dashboard (``ops.dashboard``) serves these reads, sampled by ``ops.watcher``, and
  one job's story on request (``ops.inspect``); it never writes.
* Imports: ``asnackq.dispatch``, ``asnackq.sink``, ``asnackq.store``, ``asnackq.wire``,
  ``asnackq.core``.
"""

from asnackq.ops.queries import (
    ATTENTION,
    AUDIT_SQL,
    REASONS,
    SQL_INBOX_COUNTS,
    SQL_JOB_STATES,
    VIOLATIONS,
    Audit,
    Intake,
    audit,
    dead,
    enqueue_all,
    history,
    redrive,
    redrive_by_reason,
    stats,
)

__all__ = [
    "ATTENTION",
    "AUDIT_SQL",
    "REASONS",
    "SQL_INBOX_COUNTS",
    "SQL_JOB_STATES",
    "VIOLATIONS",
    "Audit",
    "Intake",
    "audit",
    "dead",
    "enqueue_all",
    "history",
    "redrive",
    "redrive_by_reason",
    "stats",
]
