"""A traced run's spans: one CONSUMER span per delivery attempt, in its job's trace.

Rules of this module:

* A run is traced when ``asnackq.core.tracing.tracer()`` answered a tracer as the
  Dispatcher was made (``DeliverySpans.of``); an untraced run holds None and its parts
  check ``is None`` once per cycle and once per delivery, nothing more.
* The committer reads the claimed jobs' stored contexts (``asnackq.store.job_traces``) after
  each cycle, before it hands their tickets out: each attempt's span is a child of its job's
  enqueue (or last redrive), so a retry, a re-delivery after a lost lease or a killed
  worker, and a redrive are spans of the same trace.
* An attempt's span is current while its coroutine sends (the sender's CLIENT span is its
  child) and ends with its result: done, retry, dead (with the reason), stale (a finish
  the fence refused), lost (the run lost the lease), unanswered (no outcome to record),
  or abandoned (the run ended first).
* Tracing never changes a run: a failed read of contexts or reasons is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asnackq.core import tracing
from asnackq.core import worker as w
from asnackq.dispatch.seam import Queue
from asnackq.store.job_traces import SQL_PARENTS, SQL_REASONS

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from asnackq.dispatch.tickets import Claimed, Sent

__all__ = ["DeliverySpans"]

# A finish's status -> the attempt's result.
RESULTS: dict[str | bool, str] = {"done": "done", "pending": "retry", "dead": "dead"}
RESULTS[False] = "stale"  # the fence refused it


class DeliverySpans:
    """The open attempt spans of one traced run, by job id."""

    def __init__(self, tracer: Tracer, owner: str) -> None:
        self.tracer, self.owner = tracer, owner
        self.parents: dict[str, str] = {}  # claimed jobs' stored traceparents
        self.open: dict[str, tuple[int, Span]] = {}  # job id -> (token, attempt's span)

    @classmethod
    def of(cls, owner: str) -> DeliverySpans | None:
        """A run's spans when tracing is on, else None."""
        tracer = tracing.tracer()
        return None if tracer is None else cls(tracer, owner)

    async def cycled(
        self,
        queue: Queue,
        finished: Sequence[w.Ticket],
        statuses: Sequence[str | bool],
        claimed: Sequence[w.Ticket],
    ) -> None:
        """After a cycle: learn the claimed jobs' contexts, end the finished attempts' spans."""
        if claimed:
            ids = w.json_set(ticket["id"] for ticket in claimed)
            self.parents.update(await self._read(queue, SQL_PARENTS, ids))
        ends = list(zip(finished, statuses, strict=True))
        dead = [ticket["id"] for ticket, status in ends if status == "dead"]
        reasons = await self._read(queue, SQL_REASONS, w.json_set(dead)) if dead else {}
        for ticket, status in ends:
            self.end(ticket, RESULTS.get(status, str(status)), reasons.get(ticket["id"]))

    async def _read(self, queue: Queue, sql: str, ids: str) -> dict[str, Any]:
        try:
            return dict(await queue.read(sql, (ids,)))
        except asyncio.CancelledError:
            raise
        except Exception:  # no table yet (nothing enqueued traced), or the DB is away
            return {}

    def begin(self, claimed: Claimed) -> object:
        """Open the attempt's span and make it current; the token detaches it."""
        from opentelemetry import context, trace

        ticket = claimed.ticket
        span = self.tracer.start_span(
            f"deliver {tracing.DESTINATION}",
            context=tracing.context_of(self.parents.pop(ticket["id"], None)),
            kind=tracing.kind(tracing.CONSUMER),
            attributes={
                "messaging.system": tracing.SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "deliver",
                "messaging.destination.name": tracing.DESTINATION,
                "messaging.message.id": ticket["id"],
                "messaging.client.id": self.owner,
                "asnackq.token": ticket["token"],
                "asnackq.attempt": ticket["attempt"],
                "asnackq.owner": ticket["owner"],
            },
        )
        if ticket["id"] in self.open:  # a span left open by an earlier lease of the job
            self._close(self.open.pop(ticket["id"])[1], "abandoned")
        self.open[ticket["id"]] = ticket["token"], span
        return context.attach(trace.set_span_in_context(span))

    def detach(self, attached: object) -> None:
        """The send is over: the attempt's span is no longer current."""
        from opentelemetry import context

        context.detach(attached)  # type: ignore[arg-type]

    def sent(self, sent: Sent) -> None:
        """Record the send's outcome (the span ends at its finish), or end the span without one."""
        ticket = sent.claimed.ticket
        if sent.outcome is not None:
            if (held := self.open.get(ticket["id"])) is not None:
                held[1].set_attribute("asnackq.outcome", sent.outcome)
        elif sent.failure is not None:
            if (held := self.open.get(ticket["id"])) is not None:
                held[1].set_attribute("asnackq.failure", sent.failure)
            self.end(ticket, "unanswered")
        else:
            self.end(ticket, "lost")

    def end(self, ticket: w.Ticket, result: str, reason: str | None = None) -> None:
        """End the job's open attempt span (if this lease's) with its ``result``."""
        held = self.open.get(ticket["id"])
        if held is None or held[0] != ticket["token"]:
            return
        del self.open[ticket["id"]]
        if reason is not None:
            held[1].set_attribute("asnackq.dead_reason", reason)
        self._close(held[1], result)

    def _close(self, span: Span, result: str) -> None:
        span.set_attribute("asnackq.result", result)
        span.end()

    def close(self) -> None:
        """The run is over: what is still open was abandoned (it stays leased)."""
        for _, span in self.open.values():
            self._close(span, "abandoned")
        self.open.clear()
        self.parents.clear()
