"""A lab run's result: built once where the run ends, written by ``lab --json``.

Rules of this module:

* ``LabResult``'s fields are the keys of ``lab --json``, in its order; ``as_dict`` is that
  JSON, and ``LabResult.from_dict`` reads it back (the report's tests do).
* The nested values (``config``, ``series``, the invariants' rows, the faults) stay the
  JSON's dicts: the report draws them as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from asnackq.lab import schedule
from asnackq.lab.evidence import Liveness

__all__ = ["AT_LEAST", "LabResult", "report_rows"]

# A killed sink's counters are known up to its last reading, just before the SIGKILL.
AT_LEAST = {True: "", False: " (at least: each killed sink read just before its kill)"}


@dataclass(frozen=True, kw_only=True)
class LabResult:
    """One experiment: the evidence's verdict and figures (``asnackq.lab.evidence``), the
    liveness failures, the settings, the sinks' counters (lower bounds after sink kills:
    ``sink_counts_exact``), the kills, the invariants' verdicts, the time series and the
    faults with their recovery."""

    violations: list[str]
    broken: dict[str, int]
    dead_after_applied: int
    statuses: dict[str, int]
    liveness: Liveness  # with ``expected`` said
    dead_reasons: dict[str, int]
    done_reclaimed: int
    inbox_rows: int
    redelivered: int
    inbox_duplicates: int
    stock: int
    qty_total: int
    latency_ms: dict[str, Any]
    claims_traced: int
    liveness_failures: list[str]
    config: dict[str, Any]
    seconds: float
    done_per_s: float
    requests: int
    duplicates: int  # exact: the inbox's own count
    sink_failed: int
    sink_dropped: int
    sink_counts_exact: bool
    kills: int
    workers_started: int
    sinks: int
    sink_kills: int
    invariants: list[dict[str, Any]]
    series: dict[str, Any]
    faults: list[dict[str, Any]]
    faults_by_kind: dict[str, Any]
    attempts: list[dict[str, Any]] = field(default_factory=list)  # re-delivered jobs (spans)

    @property
    def failed(self) -> bool:
        """Whether any invariant broke or any job failed liveness."""
        return bool(self.violations or self.liveness_failures)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (``asnackq lab --json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabResult:
        """A result from its ``as_dict`` (a ``lab --json`` file)."""
        return cls(**{**data, "liveness": Liveness(**data["liveness"])})


def report_rows(result: LabResult) -> list[tuple[str, object]]:
    c = result.config
    latency = result.latency_ms
    exact = AT_LEAST[result.sink_counts_exact]
    return [
        ("jobs / processes / concurrency", f"{c['jobs']} / {c['processes']} / {c['concurrency']}"),
        (
            "sink faults (fail / drop / delay ms)",
            f"{c['fail_rate']} / {c['drop_rate']} / {c['delay_ms']}",
        ),
        ("seconds", result.seconds),
        ("throughput (done jobs/s)", f"{result.done_per_s:,}"),
        ("claim-to-finish p50 / p99 (ms)", f"{latency['p50']} / {latency['p99']}"),
        ("HTTP requests" + exact, result.requests),
        ("duplicates absorbed (the inbox's count)", result.duplicates),
        ("sink 503s / dropped ACKs" + exact, f"{result.sink_failed} / {result.sink_dropped}"),
        ("workers killed (SIGKILL) / started", f"{result.kills} / {result.workers_started}"),
        ("sinks / sinks killed (SIGKILL, restarted)", f"{result.sinks} / {result.sink_kills}"),
        ("final states", ", ".join(f"{k} {v}" for k, v in sorted(result.statuses.items()))),
        ("dead by reason", ", ".join(f"{k} {v}" for k, v in result.dead_reasons.items())),
        ("dead with effect applied (evidence)", result.dead_after_applied),
        (
            "liveness failures (dead, never rejected)",
            f"{result.liveness.dead_unanswered}"
            + (" (expected: the faults allow no delivery)" if result.liveness.expected else ""),
        ),
        *schedule.rows(c, result.faults_by_kind),
        ("violations", len(result.violations)),
    ]
