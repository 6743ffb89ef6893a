"""``asnackq lab``: a fault and load experiment with real processes, then the invariants.

One sink process (with its seeded faults), ``P`` worker processes (``asnackq work``, each
with ``C`` coroutines and a trace file), random SIGKILLs of workers (each replaced by a new
worker under a new owner name), then a verification from the evidence alone
(``asnackq.lab.evidence``): the queue file, the sink DB, the sink's counters and the workers'
traces.  With ``db`` (a ``postgresql://`` URL: the queue and the inbox in one database)
``K`` sink replicas share the inbox, workers spread over them, and every other SIGKILL may
hit a sink (restarted on its port); the counters of a killed sink die with it, so the
applied-counter check is then left to the inbox itself (one row per id, the stock equal to
their sum).

A fixed kill instead of random ones (``kill_after_acks`` N, the demo's): the first worker
runs alone and is SIGKILLed right after its Nth verified ACK (its effect applied, its finish
never made); then the ``P`` workers start and reclaim its leases as they expire.  However
the run is timed, that job ends done at token 2 after a duplicate the inbox absorbed.

Every claim and every finish reaches a worker's trace file before the worker's next step,
so a killed worker loses at most the line it was writing (a cut last line is ignored).

Safety and liveness are both verdicts: a job that ends dead although the sink never rejected
it is a *liveness failure* (never sent, or dead with its effect applied, or out of attempts
or time), unless the faults asked for make it expected (a fail or drop rate of 1).  Jobs get
a ttl that outlasts the run's own time bound, so no job dies of the lab's length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from asnackq import ops
from asnackq.core import worker as w
from asnackq.dispatch.traces import read_traces
from asnackq.lab import schedule, spans, timeline
from asnackq.lab.config import LabConfig
from asnackq.lab.evidence import invariants, verify
from asnackq.lab.procs import Kills, Replicas, Workers, exit_on_sigterm
from asnackq.lab.result import LabResult
from asnackq.sink.capacity import options_given
from asnackq.store import readers
from asnackq.store.outage import database_error
from asnackq.store.targets import Target, shown

__all__ = ["run_lab"]

SAMPLE_EVERY_S = 0.1  # the queue's statuses and the sink's counters, for the plots
SQL_COUNT = "SELECT count(*) FROM {table}"  # a fresh --db: no jobs, no inbox rows


def fill(queue: Target, config: LabConfig, rng: random.Random) -> dict[str, int]:
    """Enqueue the run's jobs (seeded qty); return each id with its qty."""
    qty = {f"lab-{i:07d}": rng.randint(1, 9) for i in range(config.jobs)}
    ops.enqueue_all(
        queue,
        [
            ({"id": job_id, "qty": n}, config.ttl_ms, config.max_attempts)
            for job_id, n in qty.items()
        ],
    )
    return qty


@dataclass
class Sampler:
    """The queue's jobs by status and the sink's counters, read every ``SAMPLE_EVERY_S``
    or ten times as long as a reading takes (a reader delays the workers' commits)."""

    queue: Target
    sinks: Replicas
    statuses: list[dict[str, Any]] = field(default_factory=list)
    sink: list[dict[str, Any]] = field(default_factory=list)
    due: float = -math.inf

    def __call__(self, force: bool = False) -> None:
        """Take a sample when one is due; ``force``: now, and a failure raises."""
        started = time.perf_counter()
        if not force and started < self.due:
            return
        try:
            with readers.read_only(self.queue, "jobs") as con:
                by_status = ops.stats(con, w.epoch_ms())["by_status"]
            counters = self.sinks.counters()
        except Exception as error:
            if force or not passing(error):
                raise
            return  # a SIGKILLed worker's hot journal, a database fault: the next sample
        self.statuses.append({"at": w.epoch_ms(), **by_status})
        self.sink.append({"at": w.epoch_ms(), **counters})
        self.due = started + max(SAMPLE_EVERY_S, 10 * (time.perf_counter() - started))

    def last(self, within_s: float = 60) -> None:
        """The final sample, tried again while a database fault lasts (up to ``within_s``)."""
        deadline = time.perf_counter() + within_s
        while True:
            try:
                return self(force=True)
            except Exception as error:
                if not passing(error) or time.perf_counter() > deadline:
                    raise
                time.sleep(0.2)

    @property
    def leased(self) -> int:
        return self.statuses[-1]["leased"] if self.statuses else 0

    @property
    def finished(self) -> int:
        return sum(self.statuses[-1][s] for s in ("done", "dead")) if self.statuses else 0


def passing(error: Exception) -> bool:
    """Whether a sample failed for a reason that passes: a hot journal, a database or
    sink away for a while (a 503 is an ``OSError`` too)."""
    return isinstance(error, (ValueError, OSError)) or database_error(error)


def require_empty(db: str) -> None:
    """A lab's database must hold no jobs and no inbox rows yet (absent tables are made)."""
    for table, what in (("jobs", "queue"), ("asnackq_webhook_inbox", "sink DB")):
        try:
            with readers.read_only(db, table, what) as con:
                (count,) = con.execute(SQL_COUNT.format(table=table)).fetchone()
        except ValueError:
            continue
        if count:
            raise ValueError(
                f"--db must hold no jobs and no inbox rows yet ({table}: "
                f"{count} rows): give a fresh database"
            )


def experiment(
    config: LabConfig, root: Path, console: Console, site: schedule.Site | None = None
) -> LabResult:
    """One run with its files in ``root``: fill, sinks, workers, watch, then the verdicts."""
    rng = random.Random(config.seed)
    queue: Target = config.db or root / "queue.db"
    sink_db: Target = config.db or root / "sink.db"
    if config.db is not None:
        require_empty(config.db)
    qty = fill(queue, config, rng)
    if site is None or not site.db:
        site = schedule.Site(config, str(queue))
    options = (
        "--fail-rate",
        config.fail_rate,
        "--drop-rate",
        config.drop_rate,
        "--delay-ms",
        config.delay_ms,
        "--seed",
        config.seed,
        *options_given(("--max-inflight", config.sink_max_inflight)),
        *options_given(("--max-rate", config.sink_max_rate)),
        *config.https[0],
        *site.sink_options,
        *spans.options(config.otel_exporter, config.spans),
    )
    with Replicas(sink_db, config.sinks, *options, ca_file=config.sink_ca) as sinks:
        workers = Workers(
            root,
            site.worker_db,
            sinks.urls,
            (
                "--concurrency",
                config.concurrency,
                "--lease-ms",
                config.lease_ms,
                "--timeout-s",
                config.send_timeout_s,
                "--accept-dead",
                *(() if config.rate is None else ("--rate", config.rate, "--burst", config.burst)),
                *config.https[1],
                *site.worker_options,
                *spans.options(config.otel_exporter, config.spans),
            ),
            place=site.place,
        )  # the lab judges dead jobs itself
        sampler = Sampler(queue, sinks)
        faulty = schedule.Schedule(config, site, rng)
        t0_ms, began = w.epoch_ms(), time.perf_counter()
        timed_out = watch(config, workers, sinks, sampler, rng, console, faulty)
        seconds = time.perf_counter() - began
        sampler.last()  # the final state, while the sinks still answer
        stats: dict[str, Any] = {**sampler.sink[-1], "exact": not sinks.kills}
    traces = read_traces(root)
    found = verify(queue, sink_db, qty, traces, stats)
    for failure in workers.failures.values():
        found = found.breach("workers-exit", failure)
    if timed_out:
        found = found.breach("in-time", f"the run did not end within {config.timeout_s}s")
    found = dataclasses.replace(found, liveness=found.liveness.with_expected(config.dead_expected))
    measured = timeline.measured(faulty.events, sampler.statuses, sampler.sink)
    return LabResult(
        evidence=found,
        liveness_failures=found.liveness_failures(),
        config={
            k: (str(v) if isinstance(v, Path) else shown(v) if k == "db" and v else v)
            for k, v in config.__dict__.items()
        },
        seconds=round(seconds, 3),
        done_per_s=round(found.statuses.get("done", 0) / seconds, 1),
        requests=stats["requests"],  # with sink kills, lower bounds: see Replicas
        duplicates=found.inbox_duplicates,  # exact: the inbox's own count
        sink_failed=stats["failed"],
        sink_dropped=stats["dropped"],
        sink_counts_exact=stats["exact"],
        kills=workers.kills,
        workers_started=workers.started,
        sinks=config.sinks,
        sink_kills=sinks.kills,
        invariants=invariants(found),
        series=timeline.series(
            t0_ms, traces, workers.events, sampler.statuses, sampler.sink, faulty.events
        ),
        faults=measured["faults"],
        faults_by_kind=measured["faults_by_kind"],
        sink_overloaded=stats.get("overloaded", 0),
        attempts=spans.timelines(config.spans) if config.spans else [],
    )


def start_workers(config: LabConfig, workers: Workers) -> str | None:
    """The P workers; with ``kill_after_acks``, the first alone (its owner is returned)."""
    if config.kill_after_acks:
        return workers.start("--kill-after-acks", config.kill_after_acks)
    for _ in range(config.processes):
        workers.start()
    return None


def watch(
    config: LabConfig,
    workers: Workers,
    sinks: Replicas,
    sampler: Sampler,
    rng: random.Random,
    console: Console,
    faulty: schedule.Schedule,
) -> bool:
    """Start the workers, kill one (a worker, or with ``kill_sinks`` at times a sink) every
    ``kill_every``, sample; True if the run timed out."""
    began = time.perf_counter()
    victims = sinks if config.kill_sinks else None  # sinks too, every other kill
    kills = Kills(workers, config.kill_every, rng, began + config.kill_every, victims)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as progress:
        task = progress.add_task("finished (done or dead)", total=config.jobs)
        try:
            alone = start_workers(config, workers)
            while True:
                for owner, code in workers.exited():
                    if owner == alone:  # the fixed kill happened (or it ran out of jobs)
                        if code == -signal.SIGKILL:
                            workers.killed(owner)
                        for _ in range(config.processes):
                            workers.start()
                if not workers.running:
                    return False
                time.sleep(0.05)
                now = time.perf_counter()
                sampler()
                faulty(now, working=bool(sampler.finished or sampler.leased))
                progress.update(
                    task, completed=sampler.finished, description=f"finished, {workers.kills} kills"
                )
                if sampler.finished < config.jobs:  # (then the workers end)
                    kills(now)
                if now - began > config.timeout_s:
                    return True
        finally:
            faulty.close()
            workers.stop()


def run_lab(config: LabConfig, console: Console) -> LabResult:
    """Run one experiment; files go to ``config.directory`` or a temporary directory.

    A SIGTERM ends it like Ctrl-C (``SystemExit``): every child process is stopped first.
    """
    config.check()
    with exit_on_sigterm(), contextlib.ExitStack() as stack:
        site = stack.enter_context(schedule.site(config))
        if site.server is not None:
            config = dataclasses.replace(config, db=site.db)
        if config.directory is not None:
            config.directory.mkdir(parents=True, exist_ok=True)
            return experiment(config, config.directory, console, site)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="asnackq-lab-"))
        return experiment(config, Path(tmp), console, site)
