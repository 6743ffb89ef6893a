"""A database session that may go away: the errors its callers see, and what it counts.

Rules of this module:

* A store whose server is away (restarted, its session killed, the network cut) raises
  ``StoreUnavailable`` and tries again later: reconnections are spaced by a capped,
  jittered backoff (``Backoff``), so a server coming back is not met by a stampede.
* Nothing of a transaction that raised ``StoreUnavailable`` was committed, except for
  ``CommitUnknown``: the COMMIT was sent and its answer lost, and the store could not learn
  the outcome in time.  Only a caller whose plan is safe to re-run may then try it again.
* ``Health`` counts, per store, the sessions lost, the time spent without one, the
  transactions re-run after a lost session and the COMMITs whose answer was lost.  The
  worker's summary and metrics and the sink's ``/stats`` and ``/metrics`` show these counts.
"""

from __future__ import annotations

import random
import sqlite3
import sys
import time
from dataclasses import dataclass

__all__ = [
    "BUSY",
    "HEALTH_FIELDS",
    "NO_TRANSACTION",
    "Backoff",
    "CommitUnknown",
    "Health",
    "StoreUnavailable",
    "database_error",
]

# An application's borrowed connection (``asnackq.store.borrowed``) in the wrong state.
NO_TRANSACTION = (
    "an intake on the application's connection runs inside its open transaction, "
    "and none is open: begin one first (BEGIN IMMEDIATE on SQLite, a transaction on psycopg)"
)
BUSY = "the application's connection has a transaction open: build the queue before beginning one"


def database_error(error: BaseException) -> bool:
    """Whether ``error`` is a database error (SQLite's or, when in use, psycopg's)."""
    if isinstance(error, sqlite3.Error):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(error, psycopg.Error)


# Health's counters as they appear in a worker's Summary and a sink's /stats.
HEALTH_FIELDS = ("db_outages", "db_down_ms", "db_reruns", "db_cut_commits")


class StoreUnavailable(ConnectionError):
    """Raised when the database cannot be reached now; ``retry_in_s`` says when to try again.

    The transaction that raised it committed nothing.
    """

    def __init__(self, message: str, retry_in_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_in_s = retry_in_s


class CommitUnknown(StoreUnavailable):
    """Raised when a COMMIT's answer was lost and its outcome could not be learned in time:
    the transaction may or may not have committed."""


@dataclass(frozen=True)
class Backoff:
    """Delays between reconnection attempts: doubling from ``base_s`` up to ``cap_s``, each
    drawn uniformly from its upper half (jitter spreads the clients of one server)."""

    base_s: float = 0.05
    cap_s: float = 2.0

    def delay_s(self, failures: int, draw: float) -> float:
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(failures, 30))
        return ceiling * (0.5 + draw / 2)


class Health:
    """One store's session: up or down since when, when to try again, and the counts."""

    def __init__(self, backoff: Backoff = Backoff()) -> None:
        self.backoff = backoff
        self.down_since: float | None = None  # monotonic seconds; None while up
        self.failures = 0  # reconnection attempts failed in a row
        self.next_try = 0.0  # monotonic seconds
        self.outages = self.reruns = self.cut_commits = 0
        self.down_s = 0.0  # closed outages only; see ``counts``

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def lost(self) -> None:
        """The session broke: an outage starts (unless one is already going on)."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1

    def failed(self) -> float:
        """A reconnection failed: the seconds until the next attempt."""
        self.lost()
        delay = self.backoff.delay_s(self.failures, random.random())
        self.failures += 1
        self.next_try = time.monotonic() + delay
        return delay

    def back(self) -> None:
        """A session is open again: the outage ends."""
        if self.down_since is not None:
            self.down_s += time.monotonic() - self.down_since
        self.down_since, self.failures, self.next_try = None, 0, 0.0

    def wait_s(self) -> float:
        """Seconds until a reconnection may be tried (0: now)."""
        return max(0.0, self.next_try - time.monotonic())

    def counts(self) -> dict[str, int]:
        """The counters under ``HEALTH_FIELDS`` names (the current outage counted so far)."""
        down_s = self.down_s
        if self.down_since is not None:
            down_s += time.monotonic() - self.down_since
        values = (self.outages, round(down_s * 1000), self.reruns, self.cut_commits)
        return dict(zip(HEALTH_FIELDS, values, strict=True))
