"""One-line logs for the servers (the sink, the dashboard): never a traceback.

Clients choose much of what a server logs (paths, header values, a malformed request): every
record is one line, and every byte outside printable ASCII is escaped, so a request can
neither split a line, flood the log with a traceback, nor reach the terminal.
"""

from __future__ import annotations

import logging
import re

__all__ = ["OneLine", "to_stderr"]

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
        text = UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], " ".join(text.split()))
        return f"{self.prefix}: {text[:400]}"


def to_stderr(log: logging.Logger, prefix: str) -> logging.Logger:
    """``log`` (at INFO) writing one line per record to stderr, and not to the root logger."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(OneLine(prefix))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
