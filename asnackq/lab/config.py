"""The lab's settings (``LabConfig``): every option of ``asnackq lab``, checked in one place
(``check``) before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asnackq.core import worker as w
from asnackq.core.rate import check_rate
from asnackq.lab import schedule
from asnackq.sink import faults
from asnackq.sink.capacity import Capacity
from asnackq.store.targets import is_url
from asnackq.wire.send import check_number
from asnackq.wire.tls import server_context, tls_context

__all__ = ["LabConfig"]


@dataclass
class LabConfig:
    """One experiment's settings; ``check`` refuses bad ones before anything starts."""

    jobs: int = 2000
    processes: int = 2
    concurrency: int | str = 64  # or "auto"
    fail_rate: float = 0.0
    drop_rate: float = 0.0
    delay_ms: int = 0
    sink_max_inflight: int | None = None  # the sink's capacity (asnackq.sink.capacity)
    sink_max_rate: float | None = None
    kill_every: float = 0.0
    seed: int = 1
    lease_ms: int = 2000
    send_timeout_s: float = 1.0
    max_attempts: int = 5
    timeout_s: float = 300.0
    directory: Path | None = None
    db: str | None = None  # a postgresql:// URL: the queue and the sinks' inbox
    sinks: int = 1
    kill_sinks: bool = False  # every other SIGKILL hits a sink (a random one)
    pg_local: bool = False  # db: a throwaway local server, stopped at the end
    kill_after_acks: int = 0  # the first worker alone, SIGKILLed after its Nth ACK
    tls_cert: Path | None = None  # the sinks serve https with this certificate,
    tls_key: Path | None = None  # and this key;
    sink_ca: Path | None = None  # the workers trust this CA
    hosts: int = 0  # workers on this many network namespaces (asnackq.lab.hosts)
    pg_restart_every: float = 0.0  # faults on a schedule (asnackq.lab.schedule), seconds
    pg_kill_backends_every: float = 0.0
    partition_every: float = 0.0
    partition_for: float = 0.0
    clock_skew_ms: int = 0
    rate: float | None = None  # every worker: work --rate (shared) and --burst
    burst: int = 1
    otel_exporter: str | None = None  # every process traced (``asnackq.lab.spans``),
    spans: Path | None = None  # and its spans appended to this file

    def check(self) -> None:
        w.check_int(self.jobs, "jobs", 1, 10_000_000)
        w.check_int(self.processes, "processes", 1, 64)
        if self.concurrency != "auto":
            w.check_int(self.concurrency, "concurrency", 1, 1024)
        Capacity(self.sink_max_inflight, self.sink_max_rate)  # (checks both)
        w.check_int(self.lease_ms, "lease_ms", 1, w.PRODUCT.lease_ms)
        w.check_int(self.max_attempts, "max_attempts", 1, 16)
        faults.check(self.fail_rate, self.drop_rate, self.delay_ms)
        check_number(self.kill_every, "kill_every", 0, 3600)
        w.check_int(self.kill_after_acks, "kill_after_acks", 0, self.jobs)
        if self.kill_after_acks and self.kill_every:
            raise ValueError("--kill-after-acks and --kill-every do not go together")
        check_number(self.send_timeout_s, "send_timeout_s", 0, 600, open_low=True)
        check_number(self.timeout_s, "timeout_s", 0, 86_400, open_low=True)
        if self.send_timeout_s * 1000 >= self.lease_ms:
            raise ValueError("the send timeout must be below the lease")
        if self.rate is not None:
            check_rate(self.rate, self.burst)
        w.check_int(self.sinks, "sinks", 1, 16)
        if self.db is not None and not is_url(self.db):
            raise ValueError("--db must be a postgresql:// URL (files live in --dir)")
        if self.sinks > 1 and self.db is None and not self.pg_local:
            raise ValueError("sink replicas share a PostgreSQL inbox: give --db or --pg-local")
        if self.kill_sinks and not self.kill_every:
            raise ValueError("--kill-sinks needs --kill-every")
        self.check_tls()
        schedule.check(self)
        if self.directory is not None and self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"--dir {self.directory} must be empty or absent")

    def check_tls(self) -> None:
        files = (self.tls_cert, self.tls_key, self.sink_ca)
        if any(files) and not all(files):
            raise ValueError("--tls-cert, --tls-key and --sink-ca go together")
        if self.tls_cert and self.tls_key:
            server_context(self.tls_cert, self.tls_key, None)
            tls_context("https", self.sink_ca)

    @property
    def https(self) -> tuple[tuple[object, ...], tuple[object, ...]]:
        """The sinks' TLS options and the workers', when the sinks serve https."""
        if self.tls_cert is None:
            return (), ()
        return ("--tls-cert", self.tls_cert, "--tls-key", self.tls_key), ("--sink-ca", self.sink_ca)

    @property
    def ttl_ms(self) -> int:
        """Long enough that no job dies of the run's length: its time bound, plus a minute.

        When the faults leave no way to deliver, ten leases: the jobs end dead (as expected)
        well within the run instead of outlasting it.
        """
        if self.dead_expected:
            return min(round(self.timeout_s * 1000), 10 * self.lease_ms)
        return round(self.timeout_s * 1000) + 60_000

    @property
    def dead_expected(self) -> bool:
        """Whether the faults asked for leave some jobs no way to end done."""
        return self.fail_rate >= 1 or self.drop_rate >= 1
