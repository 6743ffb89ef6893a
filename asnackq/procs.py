"""Child processes for the demo and the lab: an ``asnackq sink`` on a loopback port 0."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["sink_process", "sink_stats"]


@contextlib.contextmanager
def sink_process(db: Path, *options: str, stderr: IO[Any] | None = None) -> Iterator[str]:
    """Run ``asnackq sink --db DB OPTIONS`` and yield its URL; stopped (SIGTERM) on exit.

    The sink's log (one line per refusal) goes to ``stderr``, by default this process's.
    """
    proc = subprocess.Popen([sys.executable, "-m", "asnackq", "sink", "--db", str(db), *options],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("asnackq sink listening on "):
            raise RuntimeError(f"the sink did not start: {line!r}")
        yield line.split()[-1]
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def sink_stats(url: str) -> dict[str, int]:
    """The sink's counters (``GET /stats`` next to its ``/events`` URL)."""
    with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/stats", timeout=10) as answer:
        stats: dict[str, int] = json.load(answer)
    return stats
