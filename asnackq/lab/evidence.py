"""The judge of a run's evidence: every invariant of the lab (and so of the demo).

Rules of this module:

* The evidence is what outlives the processes: the queue, the sink's inbox (through
  ``ops.audit``, whose violations are invariants here too), the sink's counters and the
  workers' traces.  What a worker says about itself is not evidence.
* Every invariant has a name (``INVARIANTS``); a violation is a message counted under it.
* Liveness is judged as well (``LIVENESS``): a job that ended dead although the sink never
  rejected it.  Whether the faults made that expected is for the caller to say.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from asnackq import ops
from asnackq.core import worker as w
from asnackq.core.inbox import SINK_TABLE
from asnackq.lab import timeline
from asnackq.store import readers
from asnackq.store.targets import Target

__all__ = ["INVARIANTS", "LIVENESS", "Evidence", "Liveness", "invariants", "verify"]

# What the lab checks, by name: the audit's violations and the lab's own evidence.
INVARIANTS = {
    "no-job-lost": "every enqueued job ended done or dead, with its qty",
    **ops.VIOLATIONS,
    "effect-once": "the sink applied one effect per inbox row: none twice",
    "token-once": "no token was claimed twice",
    "finish-once": "no finish was accepted twice",
    "no-stale-finish": "no finish was accepted for a lease other than the job's last",
    "workers-exit": "every worker exited 0, or by the lab's SIGKILL",
    "in-time": "the run ended within --timeout-s",
}
LIVENESS = "every job the sink did not reject ended done"

# Duplicates the inbox absorbed, from its rows: committed with each delivery, so exact
# across sink restarts and SIGKILLs (a counter in memory dies with its process).
SQL_DUPLICATES = "SELECT coalesce(sum(deliveries - 1), 0) FROM asnackq_webhook_inbox"

Job = tuple[int, str, str | None, int]  # qty, status, reason, token
Record = dict[str, Any]  # one trace line


@dataclass
class Findings:
    """Violations as messages, and counted by the invariant they break."""

    messages: list[str] = field(default_factory=list)
    broken: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))

    def add(self, invariant: str, message: str, count: int = 1) -> None:
        self.messages.append(message)
        self.broken[invariant] += count


@dataclass(frozen=True, kw_only=True)
class Liveness:
    """The jobs that ended dead although the sink never rejected them (``dead_unanswered``),
    of them ``never_sent`` (up to five ``examples``), the dead with their effect applied, and
    whether the faults made it expected (for the caller to say: ``with_expected``)."""

    dead_unanswered: int
    never_sent: int
    dead_after_applied: int
    examples: list[str]
    expected: bool = False

    def with_expected(self, expected: bool) -> Liveness:
        return replace(self, expected=expected)


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """The verdict on a run's evidence: the violations (as messages, and counted by the
    invariant they ``broke``), liveness, and the figures the evidence gives."""

    violations: list[str]
    broken: dict[str, int]
    dead_after_applied: int
    statuses: dict[str, int]
    liveness: Liveness
    dead_reasons: dict[str, int]
    done_reclaimed: int
    inbox_rows: int
    redelivered: int
    inbox_duplicates: int
    stock: int
    qty_total: int
    latency_ms: dict[str, Any]
    claims_traced: int

    def breach(self, invariant: str, message: str) -> Evidence:
        """With a violation found outside ``verify`` (a worker's exit, the run's time)."""
        broken = {**self.broken, invariant: self.broken[invariant] + 1}
        return replace(self, violations=[*self.violations, message], broken=broken)

    def liveness_failures(self) -> list[str]:
        """Dead jobs the sink never rejected are a failure, unless the faults leave no way."""
        live = self.liveness
        if live.expected or not live.dead_unanswered:
            return []
        return [
            f"{live.dead_unanswered} jobs ended dead that the sink never rejected "
            f"({live.never_sent} never sent, {live.dead_after_applied} with their effect applied)"
        ]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify(
    queue: Target, sink_db: Target, qty: dict[str, int], traces: list[Record], stats: dict[str, int]
) -> Evidence:
    """Check every invariant from the evidence; return violations, evidence and figures.

    ``qty``: every enqueued id with its qty; ``stats``: the sink's counters, summed over its
    incarnations; ``exact`` false when a killed incarnation's are known only up to its last
    reading, and any sink COMMIT cut (``db_cut_commits``) makes them inexact too (then
    ``applied`` is a lower bound, and only more effects than rows is a breach).
    """
    found = Findings()
    with readers.read_only(queue, "jobs") as con:
        jobs: dict[str, Job] = {row[0]: row[1:] for row in con.execute(ops.SQL_JOB_STATES)}
    with readers.read_only(sink_db, SINK_TABLE, "sink DB") as con:
        inbox_rows, redelivered = con.execute(ops.SQL_INBOX_COUNTS).fetchone()
        (duplicates,) = con.execute(SQL_DUPLICATES).fetchone()
    check_jobs(found, jobs, qty)
    audited = ops.audit(queue, sink_db, w.epoch_ms(), limit=5)
    for flag, description in ops.VIOLATIONS.items():
        if audited.flags[flag]:
            found.add(flag, f"{audited.flags[flag]} x {flag}: {description}", audited.flags[flag])
    # A batch whose COMMIT's answer was lost may have committed uncounted (it was answered
    # 503): then, as after a kill, the counter is a lower bound.
    applied = stats.get("applied")
    exact = stats.get("exact", True) and not stats.get("db_cut_commits")
    if applied is not None and applied > inbox_rows:
        found.add(
            "effect-once",
            f"effects applied {applied} times for {inbox_rows} "
            "inbox rows: an effect was applied twice",
        )
    elif applied is not None and exact and applied < inbox_rows:
        found.add(
            "effect-once",
            f"effects counted {applied} times for {inbox_rows} inbox rows: "
            "the sink's counter misses effects it committed",
        )
    claims = check_claims(found, traces)
    latencies = check_finishes(found, traces, jobs, claims)
    statuses: dict[str, int] = {}
    for _, status, _, _ in jobs.values():
        statuses[status] = statuses.get(status, 0) + 1
    return Evidence(
        violations=found.messages,
        broken=found.broken,
        dead_after_applied=audited.flags["dead-after-applied"],
        statuses=statuses,
        liveness=liveness(jobs, audited),
        dead_reasons={
            reason: sum(1 for r in jobs.values() if r[2] == reason) for reason in ops.REASONS
        },
        done_reclaimed=sum(
            1 for _, status, _, token in jobs.values() if status == "done" and token > 1
        ),
        inbox_rows=inbox_rows,
        redelivered=redelivered,
        inbox_duplicates=int(duplicates),
        stock=audited.stock,
        qty_total=sum(qty.values()),
        latency_ms=timeline.latency(latencies),
        claims_traced=len(claims),
    )


def check_jobs(found: Findings, jobs: dict[str, Job], qty: dict[str, int]) -> None:
    """No job lost: each enqueued id ended done or dead, with the qty it was enqueued with."""
    for job_id, n in qty.items():
        row = jobs.get(job_id)
        if row is None or row[1] not in ("done", "dead"):
            found.add("no-job-lost", f"job lost or unfinished: {job_id} ({row and row[1]})")
        elif row[0] != n:
            found.add("no-job-lost", f"job {job_id} has qty {row[0]}, enqueued {n}")


def check_claims(found: Findings, traces: list[Record]) -> dict[tuple[str, int], Record]:
    """No token claimed twice; return each claim by (id, token)."""
    claims: dict[tuple[str, int], Record] = {}
    for record in traces:
        if record["e"] == "claim":
            key = (record["id"], record["token"])
            if key in claims:
                found.add(
                    "token-once",
                    f"token reused: {key} claimed by {claims[key]['owner']} and {record['owner']}",
                )
            claims[key] = record
    return claims


def check_finishes(
    found: Findings,
    traces: list[Record],
    jobs: dict[str, Job],
    claims: dict[tuple[str, int], Record],
) -> list[int]:
    """No finish accepted twice, none for a lease other than the job's last; return the
    claim-to-finish latencies of the accepted finishes."""
    accepted: dict[tuple[str, int], Record] = {}
    latencies = []
    for record in traces:
        if record["e"] != "finish" or record["status"] is False:
            continue
        key = (record["id"], record["token"])
        final = jobs.get(record["id"])
        if key in accepted:
            found.add("finish-once", f"a finish of {key} was accepted twice")
        elif (
            record["status"] in ("done", "dead")
            and final is not None
            and (final[1], final[3]) != (record["status"], record["token"])
        ):
            found.add(
                "no-stale-finish",
                f"stale finish accepted: {key} {record['status']}, "
                f"but the job ended {final[1]} at token {final[3]}",
            )
        accepted[key] = record
        if key in claims:
            latencies.append(record["at"] - claims[key]["at"])
    return latencies


def liveness(jobs: dict[str, Job], audited: ops.Audit) -> Liveness:
    """The jobs that ended dead although the sink never rejected them, by what is known."""
    unsent = sorted(
        i
        for i, (_, status, reason, token) in jobs.items()
        if status == "dead" and reason != "permanent" and token == 0
    )
    unanswered = sum(
        1 for _, status, reason, _ in jobs.values() if status == "dead" and reason != "permanent"
    )
    return Liveness(
        dead_unanswered=unanswered,
        never_sent=len(unsent),
        dead_after_applied=audited.flags["dead-after-applied"],
        examples=unsent[:5],
    )


def invariants(evidence: Evidence) -> list[dict[str, Any]]:
    """Each invariant with its verdict: holds, broken, or (liveness only) expected."""
    rows: list[dict[str, Any]] = [
        {
            "name": name,
            "description": text,
            "violations": evidence.broken[name],
            "verdict": "broken" if evidence.broken[name] else "holds",
        }
        for name, text in INVARIANTS.items()
    ]
    live = evidence.liveness
    unanswered = live.dead_unanswered
    rows.append(
        {
            "name": "liveness",
            "description": LIVENESS,
            "violations": unanswered,
            "verdict": "holds" if not unanswered else "expected" if live.expected else "broken",
        }
    )
    return rows
