"""A traced sink: a SERVER span per event POSTed, continuing the sender's trace.

Rules of this module:

* The sink is traced when ``asnackq.core.tracing.tracer()`` answered a tracer as its app was
  made; an untraced sink has no such middleware, and its handler finds no span to annotate.
* The span continues the trace the request's ``traceparent`` header names (the sender's
  CLIENT span), and records the fencing token the sink saw and the inbox's decision.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

from aiohttp import web

from asnackq.core import tracing
from asnackq.wire import http_spans

if TYPE_CHECKING:
    from aiohttp.typedefs import Middleware
    from opentelemetry.trace import Span, Tracer

__all__ = ["SPAN", "decided", "middleware"]

# The SERVER span of the request being handled (its task's), for its handler.
SPAN: ContextVar[Span | None] = ContextVar("asnackq_sink_span", default=None)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(tracer: Tracer) -> Middleware:
    """The middleware opening a SERVER span around each ``POST /events``."""

    @web.middleware
    async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        if request.method != "POST" or route is None or route.canonical != "/events":
            return await handler(request)
        parent = request.headers.get(tracing.HEADER)
        with http_spans.server(tracer, "POST", "/events", request.path, parent) as span:
            current = SPAN.set(span)
            try:
                response = await handler(request)
            except web.HTTPException as error:
                http_spans.answered(span, error.status)
                raise
            finally:
                SPAN.reset(current)
            http_spans.answered(span, response.status)
            return response

    return traced


def decided(event_id: str, token: int | None, decision: str) -> None:
    """Record what the inbox decided for this request (on its span, when traced)."""
    span = SPAN.get()
    if span is not None:
        span.set_attribute("messaging.message.id", event_id)
        if token is not None:
            span.set_attribute("asnackq.token", token)
        span.set_attribute("asnackq.inbox.decision", decision)
