"""Where a queue or a sink lives: a file path, or a ``postgresql://`` URL.

Rules of this module:

* A target is a URL only when it starts with ``postgresql://`` or ``postgres://``;
  everything else is a path (SQLite) - but for text that looks meant for a database
  elsewhere (another scheme's ``NAME://``, a mistyped ``postgres:``, a libpq keyword string
  such as ``host=... password=...``), which is refused unechoed, never made a file named
  after it; and for names SQLite reads as no file of the path's (``:memory:``, a ``file:``
  URI, which may name an in-memory database: a sink there would answer "applied" and keep
  nothing) or as a journal of another file (``NAME-wal``, ``-shm``, ``-journal``).  A file
  named like a keyword string or a URI is given by its absolute path.  Nothing here imports
  psycopg: SQLite users need no PostgreSQL driver.
* A URL is shown only through ``shown()``, and an error about one only through
  ``scrubbed()``: a password never reaches output or errors.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

__all__ = ["SCHEMES", "Target", "is_url", "one_line", "parse_target", "scrubbed", "shown"]

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
    if text.lower().startswith(("postgres:", "postgresql:")) or _SCHEME.match(text):
        raise ValueError(
            "not a PostgreSQL URL (expected postgresql://USER:PASSWORD@HOST:PORT/DATABASE)"
        )
    if _KEYWORDS.match(text):
        raise ValueError(
            "a libpq keyword string is not a target: give its database as postgresql://USER:"
            "PASSWORD@HOST:PORT/DATABASE (a file of such a name: its absolute path)"
        )
    if text == ":memory:" or text[:5].lower() == "file:":
        raise ValueError(
            "not a file's path: SQLite reads this name as an in-memory database or a URI, "
            "which may keep nothing (a file of such a name: its absolute path)"
        )
    if text.endswith(SIDE_FILES):
        raise ValueError(
            f"a name ending in {'/'.join(SIDE_FILES)} is SQLite's own for another file's "
            "journal: a queue there would be deleted, or its data taken for a journal"
        )
    return Path(text)


SIDE_FILES = ("-journal", "-wal", "-shm")  # (SQLite's names for a file's journals)


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # (a URL of any other scheme)
_KEYWORDS = re.compile(
    r"(?i)\s*(?:host|hostaddr|port|dbname|user|password|passfile|service|sslmode)\s*="
)
# The user and password of a URL, as libpq reads one, run to an '@' before any '/' ('?' and
# '#' included); a password holding a '/' (generated ones may) is then no URL libpq can
# read, and still a secret: from the first ':' after the user to the last '@' is hidden (a
# rare '@' further on hides more than the password, never less).  A parameter's value runs
# to the next '&'.
_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://[^:/@]*):(.*)@", re.IGNORECASE | re.DOTALL)
_PASSWORD = re.compile(r"(?i)([?&]password=)([^&]*)")
_PIECES = re.compile(r"[/?#&:@]")


def shown(value: Target | os.PathLike[str]) -> str:
    """A target fit for output: a URL's password replaced by ``***``."""
    text = _USERINFO.sub(r"\1:***@", os.fspath(value), count=1)
    return _PASSWORD.sub(r"\1***", text)


def scrubbed(text: str, url: str) -> str:
    """``text``, an error about ``url`` (libpq's may quote a part of it, such as a password
    it cannot decode), with ``url`` shown and each of its passwords, as written and
    decoded, replaced by ``***``."""
    found = _USERINFO.match(url)
    written = [found.group(2)] if found else []
    written += [value for _, value in _PASSWORD.findall(url)]
    # (and its pieces: libpq, reading a password that holds a '/' as a host, port and
    # database, may quote any of them)
    written += [part for raw in written for part in _PIECES.split(raw) if len(part) > 2]
    secrets = {one for raw in written for one in (raw, urllib.parse.unquote(raw)) if one}
    text = text.replace(url, shown(url))
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def one_line(error: BaseException) -> str:
    """An error's first non-empty line (libpq's messages span several)."""
    return next(
        (line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__
    )
