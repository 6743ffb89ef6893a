"""Child processes for the demo and the lab: an ``asnackq sink`` on a loopback port 0."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["Replicas", "sink_process", "sink_stats"]


@contextlib.contextmanager
def sink_process(db: Path | str, *options: str,
                 stderr: IO[Any] | None = None) -> Iterator[str]:
    """Run ``asnackq sink --db DB OPTIONS`` and yield its URL; stopped (SIGTERM) on exit.

    The sink's log (one line per refusal) goes to ``stderr``, by default this process's.
    """
    with Replicas(db, 1, *options, stderr=stderr) as sinks:
        yield sinks.urls[0]


def sink_stats(url: str) -> dict[str, int]:
    """The sink's counters (``GET /stats`` next to its ``/events`` URL)."""
    with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/stats", timeout=10) as answer:
        stats: dict[str, int] = json.load(answer)
    return stats


class Replicas:
    """K ``asnackq sink`` processes sharing one DB; one can be SIGKILLed and restarted on
    its port (its clients keep their URL).  ``with Replicas(...) as sinks:`` stops them all.

    The counters of a killed process die with it: ``counters()`` sums the live ones.
    """

    def __init__(self, db: Path | str, count: int, *options: str,
                 stderr: IO[Any] | None = None) -> None:
        self.db, self.count, self.options, self.stderr = db, count, options, stderr
        self.procs: list[subprocess.Popen[str]] = []
        self.urls: list[str] = []
        self.kills = 0

    def __enter__(self) -> Replicas:
        try:
            for _ in range(self.count):
                self.procs.append(self._start("0"))
                self.urls.append(self._url(self.procs[-1]))
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, port: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "asnackq", "sink", "--db", str(self.db),
                                 "--port", port, *self.options],
                                stdout=subprocess.PIPE, stderr=self.stderr, text=True)

    @staticmethod
    def _url(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("asnackq sink listening on "):
            raise RuntimeError(f"the sink did not start: {line!r}")
        return line.split()[-1]

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL a random replica, then start it again on the same port."""
        n = rng.randrange(self.count)
        self.procs[n].send_signal(signal.SIGKILL)
        self._reap(self.procs[n])
        self.kills += 1
        self.procs[n] = self._start(self.urls[n].rsplit(":", 1)[1].split("/")[0])
        self._url(self.procs[n])

    def counters(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for url in self.urls:
            for key, value in sink_stats(url).items():
                if key != "stock":                  # one stock, shared: not a counter
                    totals[key] = totals.get(key, 0) + value
        return totals

    @staticmethod
    def _reap(proc: subprocess.Popen[str]) -> None:
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            self._reap(proc)
