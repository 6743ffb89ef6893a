"""Where a queue or a sink lives: a file path, or a ``postgresql://`` URL.

Rules of this module:

* A target is a URL only when it starts with ``postgresql://`` or ``postgres://``;
  everything else is a path (SQLite).  Nothing here imports psycopg: SQLite users need
  no PostgreSQL driver.
* A URL is shown only through ``shown()``: a password never reaches output or errors.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

__all__ = ["SCHEMES", "Target", "is_url", "one_line", "parse_target", "shown"]

SCHEMES = ("postgresql://", "postgres://")
Target = Path | str  # a Path is a file; a str here is always a URL


def is_url(value: Any) -> bool:
    """Whether ``value`` names a PostgreSQL database rather than a file."""
    return isinstance(value, str) and value.startswith(SCHEMES)


def parse_target(text: str) -> Target:
    """Text as a target: a URL stays a str, anything else is a Path.

    A mistyped URL is refused (``ValueError``: never taken for a file name), and not
    echoed: it may hold a password.
    """
    if is_url(text):
        return text
    if text.lower().startswith(("postgres:", "postgresql:")):
        raise ValueError(
            "not a PostgreSQL URL (expected postgresql://USER:PASSWORD@HOST:PORT/DATABASE)"
        )
    return Path(text)


def shown(value: Target | os.PathLike[str]) -> str:
    """A target fit for output: a URL's password replaced by ``***``."""
    text = os.fspath(value)
    # As libpq reads a URL: the user and password run to an '@' before any '/' ('?' and '#'
    # included), and a parameter's value to the next '&'.
    text = re.sub(r"^([a-z]+://[^:/@]*):[^@/]*@", r"\1:***@", text)
    return re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", text)


def one_line(error: BaseException) -> str:
    """An error's first non-empty line (libpq's messages span several)."""
    return next(
        (line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__
    )
