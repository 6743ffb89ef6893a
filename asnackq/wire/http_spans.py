"""The HTTP spans of a send: a CLIENT span per request, a SERVER span per event received.

Rules of this module:

* A traced sender (``asnackq.wire.send``) opens a CLIENT span under the current context (a
  delivery attempt's CONSUMER span) and sends its context as the W3C ``traceparent``
  header; a traced sink continues the trace that header names in a SERVER span.
* Attributes are OpenTelemetry's HTTP semantic conventions; the sink adds what it decided
  (``asnackq.inbox.decision``: applied / duplicate / conflict) and the fencing token it saw.
* Used only when ``asnackq.core.tracing.tracer()`` answered a tracer: untraced surfaces
  never reach this module.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from asnackq.core import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["answered", "client", "server"]


@contextmanager
def client(tracer: Tracer, url: str, headers: dict[str, str]) -> Iterator[Span]:
    """A CLIENT span for one POST to ``url``; its context goes into ``headers``."""
    parts = urllib.parse.urlsplit(url)
    with tracer.start_as_current_span(
        "POST",
        kind=tracing.kind(tracing.CLIENT),
        attributes={
            "http.request.method": "POST",
            "url.full": url,
            "server.address": parts.hostname or "",
            "server.port": parts.port or (443 if parts.scheme == "https" else 80),
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        headers[tracing.HEADER] = tracing.traceparent(span)
        try:
            yield span
        except Exception as error:
            tracing.failed(span, error)
            raise


def answered(span: Span, status: int) -> None:
    """Record the HTTP status of the answer (semantic conventions: 4xx/5xx on a client
    span are errors)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        span.set_attribute("error.type", str(status))


@contextmanager
def server(
    tracer: Tracer, method: str, route: str, path: str, parent: str | None
) -> Iterator[Span]:
    """A SERVER span for one request, continuing the trace its ``traceparent`` names."""
    with tracer.start_as_current_span(
        f"{method} {route}",
        context=tracing.context_of(parent),
        kind=tracing.kind(tracing.SERVER),
        attributes={
            "http.request.method": method,
            "http.route": route,
            "url.path": path,
            "url.scheme": "http",
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span
