"""Rendering: JSON with ``--json``, rich tables and the live progress line otherwise."""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = [
    "emit",
    "iso",
    "key_values",
    "plural",
    "progress_line",
    "rows_table",
    "shown_text",
]


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 job``, ``2 jobs`` (``many``: when adding an s will not do)."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def iso(ms: int | None) -> str | None:
    """Epoch milliseconds as ISO 8601 in UTC, to the second: ``2026-12-01T17:04:05Z``."""
    if ms is None or isinstance(ms, bool) or not isinstance(ms, int):
        return None if ms is None else str(ms)
    try:
        moment = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return str(ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def emit(args: argparse.Namespace, data: object, human: Callable[[Console], None]) -> None:
    """Print ``data`` as JSON with ``--json``, else the human rendering."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=None, sort_keys=True))
    else:
        human(Console(highlight=False))


def key_values(title: str, pairs: Sequence[tuple[str, object]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in pairs:
        table.add_row(key, "-" if value is None else str(value))
    return table


def shown_text(text: str) -> str:
    """Text from outside (a receiver's answer) safe on a terminal: no control characters
    (each shown escaped), no console markup."""
    printable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return escape(printable)


def rows_table(title: str, rows: list[dict[str, Any]], keys: Sequence[str]) -> Table:
    table = Table(title=title)
    for key in keys:
        table.add_column(key)
    for row in rows:
        table.add_row(*("-" if row[key] is None else str(row[key]) for key in keys))
    return table


def progress_line(
    summary: dict[str, int], seconds: float, paused: bool, db_down: bool = False
) -> str:
    return (
        f"done {summary['done']}  retried {summary['retried']}  dead {summary['dead']}  "
        f"stale {summary['stale']}  bad ACKs {summary['bad_acks']}  "
        f"errors {summary['errors']}  {summary['done'] / max(seconds, 1e-9):,.0f} done/s"
        + (f"  DB outages {summary['db_outages']}" if summary.get("db_outages") else "")
        + (f"  429s {summary['overloaded']}" if summary.get("overloaded") else "")
        + (f"  in flight <= {summary['concurrency']}" if summary.get("concurrency") else "")
        + ("  PAUSED: the sink is not there, probing" if paused else "")
        + ("  DB DOWN: reconnecting" if db_down else "")
    )
