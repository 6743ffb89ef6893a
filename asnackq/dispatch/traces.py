"""The trace format: one JSON line per claim and per committed finish, for experiments
(and, with ``concurrency="auto"``, a ``limit`` line with the adaptive limit now and then).

``Tracer`` writes it (``asnackq work --trace FILE``): the lines of a transaction right
after its COMMIT, each reaching the OS before the worker's next step (a claimed ticket is
traced before it is sent).  A SIGKILL between a COMMIT and its lines loses them: a claim
so lost was never sent, a finish so lost is in the queue.  ``read_traces`` reads every
worker's file of a lab run back, skipping a line such a kill cut short.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from asnackq.core.worker import Ticket

__all__ = ["Tracer", "read_traces"]


class Tracer:
    """Appends claim/finish lines to a file; each reaches the OS before the next step."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def __call__(self, kind: str, ticket: Ticket, at_ms: int, status: str | bool | None) -> None:
        record = {
            "e": kind,
            "id": ticket["id"],
            "token": ticket["token"],
            "owner": ticket["owner"],
            "at": at_ms,
        }
        if kind == "finish":
            record["status"] = status
        self.file.write(json.dumps(record) + "\n")

    def limit(self, owner: str, at_ms: int, limit: int) -> None:
        """A ``limit`` line: the run's adaptive concurrency limit at ``at_ms``."""
        self.file.write(json.dumps({"e": "limit", "owner": owner, "at": at_ms, "limit": limit}))
        self.file.write("\n")

    def close(self) -> None:
        self.file.close()


def read_traces(root: Path) -> list[dict[str, Any]]:
    """Every trace line of every worker (a line cut by a SIGKILL is skipped)."""
    records = []
    for path in sorted(root.glob("*.trace")):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records
