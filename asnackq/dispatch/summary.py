"""What a Dispatcher run counts: ``Summary``, new for each run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Summary"]


@dataclass(kw_only=True)
class Summary:
    """What a dispatcher run did."""

    claimed: int = 0
    commits: int = 0  # transactions (cycles) run
    done: int = 0
    retried: int = 0
    dead: int = 0  # every job that ended dead in this run's transactions:
    dead_permanent: int = 0  # rejected by the sink,
    dead_exhausted: int = 0  # out of attempts,
    dead_deadline: int = 0  # past its deadline (finished, or by a claim's quarantine),
    dead_poison: int = 0  # or its leases ended without a result too often (Limits.max_losses)
    stale: int = 0
    lost: int = 0  # held tickets whose extension came back stale: never finished
    bad_acks: int = 0
    errors: int = 0
    requests: int = 0
    resent: int = 0  # sends repeated under the same lease: the sink was away or overloaded
    overloaded: int = 0  # answers 429, or 503 with Retry-After: the job waited, no attempt spent
    away: int = 0  # sends that found no sink (refused, reset, no connection, 502/503/504)
    timeouts: int = 0  # sends with no answer within the sender's timeout: the sink timing out
    untrusted: int = 0  # sends refused by TLS (the sink's certificate, or this worker's)
    concurrency: int = 0  # the sends let in flight (concurrency "auto": the limit at the end),
    concurrency_cuts: int = 0  # and the times the adaptive limit was cut
    extended: int = 0
    outages: int = 0  # the circuit breaker: times it opened,
    probes: int = 0  # sends it let through while open,
    paused_ms: int = 0  # and the time it was open
    clock_steps: int = 0  # times the clock stepped back (the run's clock held: see RunClock)
    clock_step_ms: int = 0  # the largest step back
    db_outages: int = 0  # the queue's database: sessions lost (``asnackq.store.outage``),
    db_down_ms: int = 0  # the time without one,
    db_reruns: int = 0  # transactions re-run after their session was lost,
    db_cut_commits: int = 0  # and COMMITs whose answer was lost (their outcome looked up)
    unconfirmed: int = 0  # tickets let go after a cycle whose COMMIT's outcome stayed unknown

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def dead_unanswered(self) -> int:
        """Jobs that ended dead although the sink never rejected them."""
        return self.dead_exhausted + self.dead_deadline + self.dead_poison

    def ended(self, reasons: dict[str, int]) -> None:
        """Count the jobs a cycle ended dead, by reason."""
        for reason, n in reasons.items():
            self.dead += n
            name = f"dead_{reason}"
            setattr(self, name, getattr(self, name) + n)

    def unanswered(self, cause: str) -> None:
        """Count one send that found no sink, by cause: away, timing_out or tls."""
        if cause == "timing_out":
            self.timeouts += 1
        elif cause == "tls":
            self.untrusted += 1
        else:
            self.away += 1

    def fail(self, failure: str) -> None:
        """Count one send that ended without an outcome: a bad ACK or another error."""
        if failure == "bad_acks":
            self.bad_acks += 1
        else:
            self.errors += 1

    def count(self, statuses: list[str | bool]) -> None:
        """Count a cycle's committed finishes by their results (False: stale)."""
        self.stale += statuses.count(False)  # (a result is a status or False)
        self.done += statuses.count("done")
        self.retried += statuses.count("pending")
