"""OpenTelemetry, optional: the one place asnackq meets its API.

Rules of this module:

* Tracing is on for a surface (a queue, a Dispatcher, a sender, a sink) when the
  ``opentelemetry-api`` package is imported and a real tracer provider is configured
  (``set_provider``, or OpenTelemetry's global one) at the moment the surface is made;
  ``tracer()`` then answers a tracer, else None.  A surface keeps that answer: with tracing
  off, its hot path checks one ``is None`` and does nothing more.
* A job's trace travels as the W3C ``traceparent`` header value: stored with the job at its
  enqueue (``asnackq.store.job_traces``), sent with each HTTP request, read back by the
  sink.  ``traceparent`` and ``context_of`` are the only converters.
* The attribute names are OpenTelemetry's semantic conventions (messaging, HTTP) where they
  exist; asnackq's own facts (fencing token, attempt, result) are ``asnackq.*``.
* Tracing never changes an outcome: a failure to read or write a trace is dropped.
* Standard library only when the API is absent; no I/O.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

from asnackq.core import VERSION

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "CLIENT",
    "CONSUMER",
    "HEADER",
    "PRODUCER",
    "SERVER",
    "SYSTEM",
    "context_of",
    "kind",
    "set_provider",
    "traceparent",
    "tracer",
]

HEADER = "traceparent"  # W3C Trace Context: version-traceid-spanid-flags
SYSTEM = "asnackq"  # messaging.system
DESTINATION = "jobs"  # messaging.destination.name: the queue's table
# The span kinds (``opentelemetry.trace.SpanKind``'s names; see ``kind``).
PRODUCER, CONSUMER, CLIENT, SERVER = "PRODUCER", "CONSUMER", "CLIENT", "SERVER"
INTERNAL = "INTERNAL"
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")

_provider: Any = None  # the provider ``set_provider`` chose, before the global one


def set_provider(provider: Any) -> None:
    """Use ``provider`` (an OpenTelemetry ``TracerProvider``; None: the global one again) for
    the surfaces made from now on - a test, or an application keeping asnackq's spans apart."""
    global _provider
    _provider = provider


def tracer() -> Tracer | None:
    """asnackq's tracer when a tracer provider is configured, else None (tracing is off)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:  # never imported: no provider can have been configured (nor is the
        return None  # API imported here, so a process that does not trace pays nothing)
    provider = _provider if _provider is not None else trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    found: Tracer = provider.get_tracer("asnackq", VERSION)
    return found


def kind(name: str) -> Any:
    """The ``SpanKind`` called ``name`` (``PRODUCER``, ``CONSUMER``, ...)."""
    from opentelemetry.trace import SpanKind

    return SpanKind[name]


def traceparent(span: Span) -> str:
    """The W3C ``traceparent`` value naming ``span`` as the parent."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def context_of(value: str | None) -> Context | None:
    """The remote parent a ``traceparent`` value names (None: absent or malformed)."""
    if value is None or (match := _TRACEPARENT.fullmatch(value)) is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id, flags = (int(part, 16) for part in match.groups())
    if not trace_id or not span_id:
        return None
    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def failed(span: Span, error: BaseException) -> None:
    """Mark ``span`` as failed by ``error`` (semantic conventions: ``error.type``)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", type(error).__qualname__)
    span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
