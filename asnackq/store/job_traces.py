"""Each job's trace: the W3C ``traceparent`` of its enqueue, stored with the job.

Rules of this module:

* The product's own table ``asnackq_job_traces(job_id, traceparent)``, on SQLite and
  PostgreSQL alike; never part of the contract's schema.  It is created by the first traced
  intake (and by a traced Dispatcher, which reads it), never by ``open_queue``.
* A traced intake writes its rows in the intake's own transaction: the plan is the core's,
  followed by the rows of the jobs it inserted (a duplicate or a conflict keeps whatever
  the job had).  A redrive replaces the row with its own span's context, in the same trace.
* Spans are made here only around plans; the plans themselves stay the core's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from asnackq.core import tracing
from asnackq.core import worker as w

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span, Tracer

__all__ = [
    "PG_TEXTS",
    "SQL_CREATE",
    "SQL_PARENTS",
    "SQL_REASONS",
    "Producing",
    "producing",
]

T = TypeVar("T")

SQL_CREATE = """CREATE TABLE IF NOT EXISTS asnackq_job_traces (job_id TEXT PRIMARY KEY,
  traceparent TEXT NOT NULL)"""
SQL_INSERT = """INSERT INTO asnackq_job_traces (job_id, traceparent) VALUES (?, ?)
ON CONFLICT (job_id) DO NOTHING"""
SQL_REPLACE = """INSERT INTO asnackq_job_traces (job_id, traceparent) VALUES (?, ?)
ON CONFLICT (job_id) DO UPDATE SET traceparent = excluded.traceparent"""
SQL_PARENT = "SELECT traceparent FROM asnackq_job_traces WHERE job_id = ?"
# Read-only, by a set of ids (one JSON array), as the core reads jobs.
SQL_PARENTS = """SELECT job_id, traceparent FROM asnackq_job_traces
WHERE job_id IN (SELECT value FROM json_each(?))"""
SQL_REASONS = "SELECT id, reason FROM jobs WHERE id IN (SELECT value FROM json_each(?))"
_ANY = "= ANY(ARRAY(SELECT json_array_elements_text(%s::json)))"
# The PostgreSQL texts that differ from SQLite's (``asnackq.store.pg_sql``).
PG_TEXTS = {
    SQL_PARENTS: f"SELECT job_id, traceparent FROM asnackq_job_traces WHERE job_id {_ANY}",
    SQL_REASONS: f"SELECT id, reason FROM jobs WHERE id {_ANY}",
}
SAME_TEXTS = (SQL_CREATE, SQL_INSERT, SQL_REPLACE, SQL_PARENT)  # but for the placeholders


def _recorded(plan: w.Plan[T], rows: list[tuple[str, str]], replace: bool) -> w.Plan[T]:
    """``plan``, then the trace rows of the jobs it inserted (or redrove), in its transaction."""
    result, changed = yield from plan
    results = result if isinstance(result, list) else [result]
    fresh = [row for row, done in zip(rows, results, strict=True) if done is True]
    if fresh:
        yield w.Sql(SQL_CREATE)
        yield w.SqlMany(SQL_REPLACE if replace else SQL_INSERT, fresh)
    return result, changed


class Producing:
    """The PRODUCER spans of one intake (one span per job, each its job's trace root)."""

    def __init__(self, spans: list[Span], ids: list[str], replace: bool = False) -> None:
        self.spans, self.replace = spans, replace
        pairs = zip(ids, spans, strict=True)
        self.rows = [(job_id, tracing.traceparent(span)) for job_id, span in pairs]

    def plan(self, make: w.Make) -> w.Make:
        """``make``'s plan, writing these spans' contexts with the jobs it inserts."""
        return lambda: _recorded(make(), self.rows, self.replace)

    def settled(self, results: Sequence[object]) -> None:
        """Record what became of each job: inserted, duplicate (kept as it was), conflict."""
        for span, result in zip(self.spans, results, strict=True):
            decision = {True: "inserted", False: "duplicate"}.get(result, "conflict")  # type: ignore[call-overload]
            span.set_attribute("asnackq.intake", decision)


@contextmanager
def producing(
    tracer: Tracer,
    ids: list[str],
    operation: str = "enqueue",
    parents: Sequence[str | None] = (),
    links: Sequence[Link] = (),
) -> Iterator[Producing]:
    """PRODUCER spans for the jobs ``ids`` for the length of their transaction; a failure
    marks them failed.  An intake starts each job's trace; a redrive (``operation``)
    continues the one its ``parents`` (stored ``traceparent`` values) name."""
    contexts = [tracing.context_of(parent) for parent in parents] or [None] * len(ids)
    spans = [
        tracer.start_span(
            f"{operation} {tracing.DESTINATION}",
            context=parent,
            kind=tracing.kind(tracing.PRODUCER),
            links=links,
            attributes={
                "messaging.system": tracing.SYSTEM,
                "messaging.operation.type": "send",
                "messaging.operation.name": operation,
                "messaging.destination.name": tracing.DESTINATION,
                "messaging.message.id": job_id,
            },
        )
        for job_id, parent in zip(ids, contexts, strict=True)
    ]
    try:
        yield Producing(spans, ids, replace=operation != "enqueue")
    except BaseException as error:
        for span in spans:
            tracing.failed(span, error)
        raise
    finally:
        for span in spans:
            span.end()


def event_ids(triples: Sequence[tuple[object, object, object]]) -> list[str]:
    """The ids of validated intakes (validation raises before any span or write)."""
    return [w.check_event(event)[0] for event, _, _ in triples]


def intake(run: Callable[[w.Make], Any], tracer: Tracer, make: w.Make, triples: Any) -> list[Any]:
    """A synchronous session's intake (``run`` runs a plan) with a PRODUCER span per job."""
    make()  # validated before any span
    with producing(tracer, event_ids(triples)) as spans:
        result = run(spans.plan(make))
        results = result if isinstance(result, list) else [result]
        spans.settled(results)
    return results


def redrive(session: Any, tracer: Tracer, job_id: str, make: w.Make, note: str) -> None:
    """A synchronous redrive in the job's trace: the operator's action is a span of its own
    (its note attached), linked from the redrive's span, whose context the job keeps."""
    from opentelemetry.trace import Link

    make()  # validated before any span
    parent = stored_parent(session, job_id)
    with tracer.start_as_current_span(
        "redrive", kind=tracing.kind(tracing.INTERNAL), attributes={"asnackq.note": note}
    ) as action:
        link = Link(action.get_span_context())
        with producing(tracer, [job_id], "redrive", [parent], [link]) as spans:
            session.run(spans.plan(make))


def stored_parent(session: Any, job_id: str) -> str | None:
    """A job's stored ``traceparent`` (None: none, or no table yet)."""
    from asnackq.store.outage import database_error

    try:
        row = session.execute(SQL_PARENT, (job_id,)).fetchone()
    except Exception as error:
        if not database_error(error):
            raise
        return None
    return None if row is None else str(row[0])
