"""The lab's site and its faults on a schedule: where the processes run, and what hits them.

Rules of this module:

* A ``Site`` is what the run was given: the throwaway PostgreSQL server (``--pg-local``),
  the hosts (``--hosts``, ``asnackq.lab.hosts``) and the superuser's password for them.  Workers
  on hosts reach the server over TCP on the hosts' link; sinks stay in the root namespace
  and listen on the link's sink address (``--allow-remote``: it is not loopback); workers
  send there with ``--allow-remote --allow-network`` the link's private network.
* Each fault kind has its own period in seconds (0: never); the first comes one period
  after the workers are first seen at work, the next one period after the last ended.
* A fault is an event with its kind, what it hit, when it began and when it healed (epoch
  ms): a restart heals when ``pg_ctl`` returns (the server takes connections again),
  killed backends at once, a partition ``partition_for`` seconds after it began.
* Restarts alternate ``fast`` and ``immediate``; killed backends are every client backend
  but the lab's own; a partition cuts a random host, not cut already, off from the
  database, the sinks or both (``hosts.TARGETS``).
* ``close()`` heals every partition still open, so the workers can be stopped.
* Clock skew: each slot (a host, else a worker's number among the processes) reads the
  run's clock ``offsets`` off: evenly spread over ``[-K, K]``, each slot a different amount.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from asnackq.core.worker import check_int, epoch_ms
from asnackq.lab import hosts
from asnackq.lab.hosts import MAX_HOSTS, TARGETS, Hosts
from asnackq.lab.pg_server import DURABLE, SUPERUSER, LocalServer, local_server
from asnackq.wire.send import check_number

__all__ = ["KINDS", "Schedule", "Site", "check", "offsets", "rows", "site"]

KINDS = ("pg-restart", "pg-kill-backends", "partition")
MODES = ("fast", "immediate")
CLOCK_SKEW_MS = 86_400_000
SQL_KILL_BACKENDS = """SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
AND datname = current_database()"""


class Faulted(Protocol):
    """The lab settings this module reads (``LabConfig``'s)."""

    db: str | None
    pg_local: bool
    processes: int
    hosts: int
    pg_restart_every: float
    pg_kill_backends_every: float
    partition_every: float
    partition_for: float
    clock_skew_ms: int

    @property
    def ttl_ms(self) -> int: ...


def check(config: Faulted) -> None:
    """``ValueError`` for a fault option out of range, or one without what it needs."""
    check_int(config.hosts, "hosts", 0, MAX_HOSTS)
    if config.hosts:
        hosts.require()
    for name in ("pg_restart_every", "pg_kill_backends_every", "partition_every"):
        check_number(getattr(config, name), name, 0, 3600)
    check_number(config.partition_for, "partition_for", 0, 3600)
    check_int(config.clock_skew_ms, "clock_skew_ms", 0, CLOCK_SKEW_MS)
    local = config.pg_local and config.db is None
    if config.hosts and not local:
        raise ValueError("--hosts needs --pg-local (the server listens on the hosts' link)")
    if config.pg_restart_every and not local:
        raise ValueError("--pg-restart-every needs --pg-local (the lab restarts its own server)")
    if config.pg_kill_backends_every and not (config.db or config.pg_local):
        raise ValueError("--pg-kill-backends-every needs --db or --pg-local")
    if bool(config.partition_every) != bool(config.partition_for):
        raise ValueError("--partition-every and --partition-for go together")
    if config.partition_every and not config.hosts:
        raise ValueError("--partition-every needs --hosts (a partition cuts a host off)")
    if config.partition_for * 1000 >= config.ttl_ms:
        raise ValueError("--partition-for must be shorter than the jobs' ttl")


def offsets(skew_ms: int, slots: int) -> list[int]:
    """``slots`` clock offsets spread evenly over ``[-skew_ms, skew_ms]`` (one: ``+skew``)."""
    if slots == 1:
        return [skew_ms]
    return [round(-skew_ms + 2 * skew_ms * i / (slots - 1)) for i in range(slots)]


@dataclass
class Site:
    """Where a run's processes are: its server and hosts (either may be absent)."""

    config: Faulted
    db: str
    server: LocalServer | None = None
    hosts: Hosts | None = None
    password: str = ""

    @property
    def worker_db(self) -> str:
        """The queue as the workers reach it: over the hosts' link, else the lab's URL."""
        if self.hosts is None or self.server is None:
            return self.db
        where = f"{self.hosts.db_addr}:{self.server.port}"
        return f"postgresql://{SUPERUSER}:{self.password}@{where}/postgres"

    @property
    def sink_options(self) -> tuple[object, ...]:
        return () if self.hosts is None else ("--host", self.hosts.sink_addr, "--allow-remote")

    @property
    def worker_options(self) -> tuple[object, ...]:
        """A worker on a host sends to the sink over the hosts' private link: it allows
        remote sinks, and that link's network."""
        if self.hosts is None:
            return ()
        return ("--allow-remote", "--allow-network", str(self.hosts.subnet))

    def host_of(self, n: int) -> int | None:
        return None if self.hosts is None else n % self.hosts.count

    def place(self, n: int) -> tuple[list[str], list[object]]:
        """Worker ``n``'s argv prefix (its host) and own options (its clock)."""
        slots = self.hosts.count if self.hosts is not None else self.config.processes
        own: list[object] = []
        if self.config.clock_skew_ms:
            own = ["--clock-offset-ms", offsets(self.config.clock_skew_ms, slots)[n % slots]]
        host = self.host_of(n)
        prefix = [] if host is None or self.hosts is None else self.hosts.argv(host)
        return prefix, own


@contextlib.contextmanager
def site(config: Faulted) -> Iterator[Site]:
    """The run's hosts and throwaway server (``--pg-local``), made in that order (the
    server listens on the hosts' link) and removed on the way out."""
    with contextlib.ExitStack() as stack:
        made = stack.enter_context(Hosts(config.hosts)) if config.hosts else None
        if not (config.pg_local and config.db is None):
            yield Site(config, config.db or "", hosts=made)
            return
        settings = dict(DURABLE)
        if made is not None:
            settings["listen_addresses"] = f"127.0.0.1,{made.db_addr}"
        server = stack.enter_context(local_server(settings))
        where = Site(config, server.url(), server, made, secrets.token_hex(16))
        if made is not None:
            open_to(server, str(made.subnet), where.password)
        yield where


def open_to(server: LocalServer, network: str, password: str) -> None:
    """Let ``network`` (a CIDR) in over TCP with the superuser's new ``password``
    (``scram-sha-256``); the server listens on an address there already."""
    import psycopg
    from psycopg import sql

    with open(server.data / "pg_hba.conf", "a", encoding="utf-8") as hba:
        hba.write(f"host all {SUPERUSER} {network} scram-sha-256\n")
    with psycopg.connect(server.url(), autocommit=True) as con:
        alter = sql.SQL("ALTER ROLE {} PASSWORD {}")
        con.execute(alter.format(sql.Identifier(SUPERUSER), sql.Literal(password)))
        con.execute("SELECT pg_reload_conf()")


@dataclass
class Schedule:
    """The faults of one run, each done when due; ``events`` records them (epoch ms)."""

    config: Faulted
    site: Site
    rng: random.Random
    events: list[dict[str, Any]] = field(default_factory=list)
    due: dict[str, float] = field(default_factory=dict)
    cut: dict[int, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    @property
    def periods(self) -> dict[str, float]:
        c = self.config
        every = (c.pg_restart_every, c.pg_kill_backends_every, c.partition_every)
        return {kind: period for kind, period in zip(KINDS, every, strict=True) if period}

    def __call__(self, now: float, working: bool) -> None:
        """Heal what is due, then do every fault that is due (``now``: perf_counter).  The
        first of each kind comes one period after the workers were first seen ``working``
        (a job leased or done): a worker that cannot open the queue at all exits."""
        if not self.due and working:
            self.due = {kind: now + period for kind, period in self.periods.items()}
        for host, (heal_at, event) in list(self.cut.items()):
            if now >= heal_at:
                self.heal(host, event)
        actions = {"pg-restart": self.restart, "pg-kill-backends": self.kill}
        for kind, at in self.due.items():
            if now >= at:
                actions.get(kind, self.cut_one)()
                self.due[kind] = time.perf_counter() + self.periods[kind]

    def record(self, kind: str, detail: str, at: int, until: int | None) -> dict[str, Any]:
        event = {"at": at, "kind": kind, "detail": detail, "until": until}
        self.events.append(event)
        return event

    def restart(self) -> None:
        assert self.site.server is not None
        mode = MODES[sum(e["kind"] == "pg-restart" for e in self.events) % 2]
        at = epoch_ms()
        self.site.server.restart(mode)
        self.record("pg-restart", mode, at, epoch_ms())

    def kill(self) -> None:
        import psycopg

        at = epoch_ms()
        with psycopg.connect(self.site.db, autocommit=True) as con:
            row = con.execute(SQL_KILL_BACKENDS).fetchone()
        self.record("pg-kill-backends", f"{row[0] if row else 0} backends", at, at)

    def cut_one(self) -> None:
        hosts = self.site.hosts
        assert hosts is not None
        whole = [i for i in range(hosts.count) if i not in self.cut]
        if not whole:
            return
        host, target = self.rng.choice(whole), self.rng.choice(TARGETS)
        hosts.partition(host, target)
        event = self.record("partition", f"h{host} from {target}", epoch_ms(), None)
        self.cut[host] = (time.perf_counter() + self.config.partition_for, event)

    def heal(self, host: int, event: dict[str, Any]) -> None:
        assert self.site.hosts is not None
        self.site.hosts.heal(host)
        event["until"] = epoch_ms()
        del self.cut[host]

    def close(self) -> None:
        """Heal every partition still open."""
        for host, (_, event) in list(self.cut.items()):
            self.heal(host, event)


def rows(c: dict[str, Any], faults_by_kind: dict[str, Any]) -> list[tuple[str, object]]:
    """The report's rows for the faults: hosts and clock skew (from the run's settings
    ``c``), then each kind's count, recovery p50 / max and duplicates (none without faults)."""
    out: list[tuple[str, object]] = []
    if c.get("hosts") or c.get("clock_skew_ms"):
        out.append(("hosts / clock skew up to (ms)", f"{c['hosts']} / {c['clock_skew_ms']}"))
    for kind, row in faults_by_kind.items():
        p50, top = (seconds(row[k]) for k in ("recovery_p50_ms", "recovery_max_ms"))
        unrecovered = f", {row['unrecovered']} not before the end" if row["unrecovered"] else ""
        out.append(
            (
                f"{kind}: faults / recovery p50, max (s) / duplicates",
                f"{row['count']} / {p50}, {top}{unrecovered} / {row['duplicates']}",
            )
        )
    return out


def seconds(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f}"
