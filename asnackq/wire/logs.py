"""One-line logs for the commands (a worker, the sink, the dashboard): never a traceback.

Clients choose much of what a server logs (paths, header values, a malformed request): every
record is one line, and every byte outside printable ASCII is escaped, so a request can
neither split a line, flood the log with a traceback, nor reach the terminal.

Two formats (``--log-format``): ``text``, ``PREFIX: message key=value ...`` (the record's
structured ``fields``, as a worker's events carry them); ``json``, one object per line with
``time`` (ISO 8601, UTC), ``level``, ``logger``, ``event``, ``message`` and the fields.
Library code only logs (under the ``asnackq`` logger); the commands add the handler.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from typing import IO, Any

__all__ = ["FORMATS", "JsonLine", "OneLine", "to_stderr"]

FORMATS = ("text", "json")
LONG = {"summary"}  # fields a text line leaves out (a stopped run's: the command prints it)

UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


class OneLine(logging.Formatter):
    """A record on one line: ``PREFIX: message: ErrorType: error``, at most 400 characters."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            text += f": {type(error).__name__}: {error}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += "".join(
                f" {key}={shown(value)}" for key, value in fields.items() if key not in LONG
            )
        text = UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], " ".join(text.split()))
        return f"{self.prefix}: {text[:1000]}"


def shown(value: object) -> str:
    """A field's value in a text line: JSON for containers and strings with spaces."""
    if isinstance(value, (dict, list)) or (isinstance(value, str) and (" " in value or not value)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


class JsonLine(logging.Formatter):
    """A record as one JSON object (non-ASCII escaped, so it is one line of ASCII)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None),
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update({key: value for key, value in fields.items() if key not in line})
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line["error"] = f"{type(error).__name__}: {error}"
        return json.dumps(line, default=str)


class Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each record (a live display may wrap it)."""

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def to_stderr(log: logging.Logger, prefix: str, fmt: str = "text") -> logging.Logger:
    """``log`` (at INFO) writing one line per record to stderr, and not to the root logger."""
    if not log.handlers:
        handler = Stderr()
        handler.setFormatter(JsonLine() if fmt == "json" else OneLine(prefix))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
