"""A lab run's result: built once where the run ends, written by ``lab --json``.

Rules of this module:

* ``LabResult``'s fields are the keys of ``lab --json``, in its order; ``as_dict`` is that
  JSON, and ``LabResult.from_dict`` reads it back (the report's tests do).
* The nested values (``config``, ``series``, the invariants' rows, the faults) stay the
  JSON's dicts: the report draws them as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from asnackq.lab import schedule
from asnackq.lab.evidence import Evidence, Liveness

__all__ = ["AT_LEAST", "LabResult", "report_rows"]

# A killed sink's counters are known up to its last reading, just before the SIGKILL.
AT_LEAST = {True: "", False: " (at least: each killed sink read just before its kill)"}


@dataclass(frozen=True, kw_only=True)
class LabResult:
    """One experiment: the evidence's verdict and figures (``asnackq.lab.evidence``), the
    liveness failures, the settings, the sinks' counters (lower bounds after sink kills:
    ``sink_counts_exact``), the kills, the invariants' verdicts, the time series and the
    faults with their recovery."""

    evidence: Evidence  # its liveness with ``expected`` said
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
    sink_overloaded: int = 0  # answers 429: past the sink's capacity
    attempts: list[dict[str, Any]] = field(default_factory=list)  # re-delivered jobs (spans)

    @property
    def failed(self) -> bool:
        """Whether any invariant broke or any job failed liveness."""
        return bool(self.evidence.violations or self.liveness_failures)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (``asnackq lab --json``): the evidence's fields
        first, then the run's."""
        data = asdict(self)
        return {**data.pop("evidence"), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabResult:
        """A result from its ``as_dict`` (a ``lab --json`` file)."""
        names = {f.name for f in fields(Evidence)}
        found = {k: v for k, v in data.items() if k in names}
        found["liveness"] = Liveness(**found["liveness"])
        rest = {k: v for k, v in data.items() if k not in names}
        return cls(evidence=Evidence(**found), **rest)


def report_rows(result: LabResult) -> list[tuple[str, object]]:
    c = result.config
    latency = result.evidence.latency_ms
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
        ("sink 429s (past its capacity)" + exact, result.sink_overloaded),
        ("workers killed (SIGKILL) / started", f"{result.kills} / {result.workers_started}"),
        ("sinks / sinks killed (SIGKILL, restarted)", f"{result.sinks} / {result.sink_kills}"),
        (
            "final states",
            ", ".join(f"{k} {v}" for k, v in sorted(result.evidence.statuses.items())),
        ),
        ("dead by reason", ", ".join(f"{k} {v}" for k, v in result.evidence.dead_reasons.items())),
        ("dead with effect applied (evidence)", result.evidence.dead_after_applied),
        (
            "liveness failures (dead, never rejected)",
            f"{result.evidence.liveness.dead_unanswered}"
            + (
                " (expected: the faults allow no delivery)"
                if result.evidence.liveness.expected
                else ""
            ),
        ),
        *schedule.rows(c, result.faults_by_kind),
        ("violations", len(result.evidence.violations)),
    ]
