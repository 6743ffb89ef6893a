"""A traced lab run: its processes' tracing options, and the attempt timelines of its spans.

Rules of this module:

* ``lab --otel-exporter otlp|console`` and ``lab --spans FILE`` are passed on as they are to
  every worker and sink; the lab's own process (its intake) is configured by the command
  line.  Every process appends to the one FILE, a JSON object per span and line (a line a
  SIGKILL cut short is skipped; the killed process's unended spans are never written).
* Spans are not worth a delivery: a FILE that cannot take a line (a full disk, a device
  refusing writes) drops spans, said in one line of the ``asnackq.spans`` logger, and one more
  when lines go in again; the run goes on.  A FIFO, a directory or a socket is refused at
  start (a FIFO with no reader would block the command).
* ``timelines`` picks the jobs that were delivered more than once (more than one attempt
  span, or more than one request at the sink) and lays out their attempts in time: owner,
  token, attempt, result, and what the sink decided for each token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import stat
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

__all__ = ["json_lines", "options", "record", "timelines"]

SHOWN = 6  # the re-delivered jobs a report shows


def options(exporter: str | None, spans: Path | None) -> tuple[object, ...]:
    """The options that trace a worker or a sink as the lab is traced."""
    return (
        *(("--otel-exporter", exporter) if exporter else ()),
        *(("--spans", spans) if spans else ()),
    )


LOG = logging.getLogger("asnackq.spans")


def json_lines(path: Path) -> Any:
    """An SDK exporter appending each span to ``path`` as one JSON line (``record``), each
    line in one ``write`` (line-buffered, ``O_APPEND``): processes sharing the file never
    mix their lines.  ``ValueError`` (one line) for a path that is no file to append to."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    with contextlib.suppress(FileNotFoundError):
        kind = stat.S_IFMT(path.stat().st_mode)
        if kind in (stat.S_IFIFO, stat.S_IFDIR, stat.S_IFSOCK):
            raise ValueError(f"--spans {path}: not a file to append spans to")
    try:
        file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    except OSError as error:
        raise ValueError(f"--spans {path}: {error.strerror}") from None

    class Exporter(SpanExporter):
        def __init__(self) -> None:
            self.file, self.failing = file, False

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            try:
                for span in spans:
                    self.file.write(json.dumps(record(span)) + "\n")
            except OSError as error:
                if not self.failing:
                    LOG.warning(
                        "spans: cannot append to %s (%s): spans are dropped until it can",
                        path,
                        error.strerror,
                    )
                self.failing = True
                return SpanExportResult.FAILURE
            if self.failing:
                LOG.warning("spans: appending to %s again", path)
                self.failing = False
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            with contextlib.suppress(OSError):  # (a last line that cannot go in)
                self.file.close()

    return Exporter()


def record(span: ReadableSpan) -> dict[str, Any]:
    """A span as one JSON object: ids in hex, times in epoch nanoseconds."""
    context, parent = span.get_span_context(), span.parent
    return {
        "trace": f"{context.trace_id:032x}" if context else None,
        "span": f"{context.span_id:016x}" if context else None,
        "parent": None if parent is None else f"{parent.span_id:016x}",
        "name": span.name,
        "kind": span.kind.name,
        "start": span.start_time,
        "end": span.end_time,
        "service": span.resource.attributes.get("service.name"),
        "attributes": dict(span.attributes or {}),
    }


def read(path: Path) -> list[dict[str, Any]]:
    """Every whole span line of ``path``."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def timelines(path: Path, shown: int = SHOWN) -> list[dict[str, Any]]:
    """The attempt timelines of up to ``shown`` re-delivered jobs (times in ms from the
    first attempt), in the order of their job ids."""
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in read(path):
        job_id = span["attributes"].get("messaging.message.id")
        if span["kind"] in ("CONSUMER", "SERVER") and job_id is not None:
            by_job[job_id].append(span)
    again = sorted(
        job_id
        for job_id, spans in by_job.items()
        if max(sum(s["kind"] == kind for s in spans) for kind in ("CONSUMER", "SERVER")) > 1
    )
    return [timeline(job_id, by_job[job_id]) for job_id in again[:shown]]


def timeline(job_id: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's attempts and the sink's decisions, in time."""
    t0 = min(span["start"] for span in spans)

    def ms(ns: int) -> float:
        return float(round((ns - t0) / 1e6, 1))

    attempts = [
        {
            "owner": s["attributes"].get("asnackq.owner"),
            "token": s["attributes"].get("asnackq.token"),
            "attempt": s["attributes"].get("asnackq.attempt"),
            "result": s["attributes"].get("asnackq.result"),
            "start_ms": ms(s["start"]),
            "end_ms": ms(s["end"]),
        }
        for s in sorted(spans, key=lambda s: s["start"])
        if s["kind"] == "CONSUMER"
    ]
    decisions = [
        {
            "token": s["attributes"].get("asnackq.token"),
            "decision": s["attributes"].get("asnackq.inbox.decision"),
            "at_ms": ms(s["start"]),
        }
        for s in sorted(spans, key=lambda s: s["start"])
        if s["kind"] == "SERVER"
    ]
    traces = sorted({span["trace"] for span in spans})
    return {"id": job_id, "traces": traces, "attempts": attempts, "sink": decisions}
