"""``--otel-exporter otlp|console`` (and ``--spans FILE``): configure OpenTelemetry's SDK for
one command.

Rules of this module:

* Tracing stays off unless asked for: without these options nothing of OpenTelemetry is
  imported.  Asked for without the SDK installed: one line, exit 2, nothing changed
  (``exporting`` runs before any file is opened).
* ``otlp`` sends to the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) over HTTP/protobuf; ``console`` prints each span to
  stderr (stdout stays the command's); ``--spans FILE`` appends each span as a JSON line
  (``asnackq.lab.spans``).
* The provider is OpenTelemetry's global one, set before any queue, sender or sink is made,
  and shut down when the command ends: its last spans get ``FLUSH_S`` to be exported, then
  an export still retrying (no collector there) gives up, so a command ends within about two
  seconds of its work whatever the collector does.  A SIGKILL loses what was not exported.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asnackq.cli.common import Usage

__all__ = ["EXPORTERS", "add_otel", "exporting"]

EXPORTERS = ("otlp", "console")
FLUSH_S = 2.0  # how long a command's last spans may take to export as it ends
OTLP_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
MISSING = (
    "{option} needs the OpenTelemetry SDK: pip install opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http"
)


def add_otel(parser: argparse.ArgumentParser, spans: bool = True) -> None:
    """Add ``--otel-exporter`` (and ``--spans FILE``) to a command."""
    parser.add_argument(
        "--otel-exporter",
        choices=EXPORTERS,
        default=None,
        help="trace with OpenTelemetry's SDK: otlp (to OTEL_EXPORTER_OTLP_ENDPOINT) or "
        "console (stderr); docs/tracing.md",
    )
    if spans:
        parser.add_argument(
            "--spans",
            type=Path,
            default=None,
            metavar="FILE",
            help="also append each span to FILE (JSON lines)",
        )


@contextlib.contextmanager
def exporting(args: argparse.Namespace, service: str) -> Iterator[None]:
    """The SDK configured as the options ask, for the length of the command (or nothing)."""
    exporter, spans = getattr(args, "otel_exporter", None), getattr(args, "spans", None)
    if exporter is None and spans is None:
        yield
        return
    provider, otlp = _provider(
        service, exporter, spans, "--otel-exporter" if exporter else "--spans"
    )
    try:
        yield
    finally:
        end(provider, otlp)


def end(provider: Any, otlp: Any) -> None:
    """Shut the provider down, its last spans given ``FLUSH_S``: then an export still
    retrying gives up, and one still waiting for a collector's answer is left behind (the
    shutdown runs in a daemon thread, and the provider has no shutdown at exit)."""
    logger = logging.getLogger(OTLP_LOGGER)
    logger.addFilter(already_shut)
    ending = threading.Thread(target=provider.shutdown, name="asnackq-otel-end", daemon=True)
    ending.start()
    ending.join(FLUSH_S)
    if ending.is_alive() and otlp is not None:
        otlp.shutdown()  # (a retry's wait ends at once)
        ending.join(0.5)
    if not ending.is_alive():
        logger.removeFilter(already_shut)


def already_shut(record: logging.LogRecord) -> bool:
    """Drop the SDK's "already shutdown" warnings: the exporter given up on by ``exporting``
    is shut down again by its provider."""
    return "already shutdown" not in str(record.msg)


def _provider(
    service: str, exporter: str | None, spans: Path | None, option: str
) -> tuple[Any, Any]:
    """The SDK's provider, set as the global one, and its OTLP exporter (None: no OTLP)."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        raise Usage(MISSING.format(option=option)) from None
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}), shutdown_on_exit=False
    )
    otlp = None
    if exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise Usage(MISSING.format(option=option)) from None
        otlp = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(otlp))
    elif exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    if spans is not None:
        from asnackq.lab.spans import json_lines

        provider.add_span_processor(SimpleSpanProcessor(json_lines(spans)))
    trace.set_tracer_provider(provider)
    return provider, otlp
