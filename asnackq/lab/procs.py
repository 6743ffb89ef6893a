"""Child processes: ``asnackq`` sinks and workers, started, SIGKILLed, reaped and stopped here.

Rules of this module (the lab, the demo, the command line and the tests start children
through it):

* Whoever starts a process stops it: ``stop`` sends SIGTERM, waits up to ``STOP_S``, then
  sends SIGKILL; either way the process is reaped and its pipes are closed.
  ``with started(...)`` does that on the way out, whatever happened.
* A kill is a real SIGKILL, reaped at once: no zombie, and its exit code (-9) is known.
* A sink listens on port 0 (or on the port of the replica it replaces): its first line
  names its URL, read before its clients start.
* ``exit_on_sigterm``: a SIGTERM to this process raises ``SystemExit``, so that every
  ``finally`` that stops children runs when an experiment is itself stopped.
* A child ends with the process that started it: it gets the read end of a pipe only that
  process writes to (``LIFELINE_ENV``, ``asnackq.cli.lifeline``), so a lab SIGKILLed, or a
  test process ended without its ``finally``, leaves none running.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from asnackq.core.worker import epoch_ms
from asnackq.store.targets import Target

__all__ = [
    "Kills",
    "Replicas",
    "Workers",
    "command",
    "exit_on_sigterm",
    "kill",
    "sink_process",
    "sink_stats",
    "start",
    "start_sink",
    "started",
    "stop",
    "worker",
]

STOP_S = 30  # how long a SIGTERMed child has to exit before it is SIGKILLed
LIFELINE_ENV = "ASNACKQ_LIFELINE_FD"  # (read by the child: asnackq.cli.lifeline)
PIPE = subprocess.PIPE
Stream = IO[Any] | int | None
Proc = subprocess.Popen[str]
# worker N -> (argv prefix, its own options): a lab host's ``ip netns exec`` and clock
Placement = Callable[[int], tuple[Sequence[str], Sequence[object]]]


def command(*args: object) -> list[str]:
    """The argv of ``asnackq ARGS`` run by this interpreter (``python -m asnackq``)."""
    return [sys.executable, "-m", "asnackq", *map(str, args)]


def start(
    argv: Sequence[str], *, stdin: Stream = None, stdout: Stream = None, stderr: Stream = None
) -> Proc:
    """Start ``argv`` (text pipes); the caller stops it with ``stop`` or ``kill``.  An
    ``asnackq`` child SIGTERMs itself when this process ends (its lifeline)."""
    fd = lifeline()
    env = {**os.environ, LIFELINE_ENV: str(fd)}
    return subprocess.Popen(
        argv, stdin=stdin, stdout=stdout, stderr=stderr, text=True, env=env, pass_fds=(fd,)
    )


_LIFELINE: list[int] = []  # this process's lifeline: the read end (the write end is kept)


def lifeline() -> int:
    """The read end of this process's lifeline, made once: its write end stays open, and
    unshared, for as long as this process lives."""
    if not _LIFELINE:
        read_end, write_end = os.pipe()  # (neither inherited but where passed)
        _LIFELINE[:] = [read_end, write_end]
    return _LIFELINE[0]


def reap(proc: Proc, timeout_s: float = STOP_S) -> int:
    """Wait for ``proc`` to exit, close its pipes, and return its exit code."""
    code = proc.wait(timeout=timeout_s)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return code


def kill(proc: Proc) -> int:
    """SIGKILL ``proc`` and reap it (its exit code: -9, or the code it had already)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    return reap(proc)


def stop(*procs: Proc, timeout_s: float = STOP_S) -> list[int]:
    """SIGTERM every process still running, then reap each; one that is still running after
    ``timeout_s`` is SIGKILLed.  Returns the exit codes in order."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    codes = []
    for proc in procs:
        try:
            codes.append(reap(proc, timeout_s))
        except subprocess.TimeoutExpired:
            codes.append(kill(proc))
    return codes


@contextlib.contextmanager
def started(
    argv: Sequence[str], *, stdin: Stream = None, stdout: Stream = None, stderr: Stream = None
) -> Iterator[Proc]:
    """``with started(argv) as proc:`` - ``stop(proc)`` on the way out."""
    proc = start(argv, stdin=stdin, stdout=stdout, stderr=stderr)
    try:
        yield proc
    finally:
        stop(proc)


def worker(
    queue: Target,
    url: str | None,
    *options: object,
    prefix: Sequence[str] = (),
    stdout: Stream = None,
    stderr: Stream = None,
) -> Proc:
    """Start ``asnackq work QUEUE --sink URL OPTIONS`` (a worker process; with no ``url``,
    ``asnackq work QUEUE OPTIONS``: the fleet, every endpoint of the queue), run through
    ``prefix`` if given (``ip netns exec NAME``: the same process, on a lab host)."""
    sink = () if url is None else ("--sink", url)
    argv = [*prefix, *command("work", queue, *sink, *options)]
    return start(argv, stdout=stdout, stderr=stderr)


def start_sink(
    db: Target, *options: object, port: int | str = 0, stderr: Stream = None
) -> tuple[Proc, str]:
    """Start ``asnackq sink --db DB --port PORT OPTIONS``; return it with its URL once it
    listens.  A sink that does not start is stopped, and ``RuntimeError`` says its line."""
    proc = start(command("sink", "--db", db, "--port", port, *options), stdout=PIPE, stderr=stderr)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("asnackq sink listening on "):
        stop(proc)
        raise RuntimeError(f"the sink did not start: {line!r}")
    return proc, line.split()[-1]


@contextlib.contextmanager
def sink_process(db: Target, *options: object, stderr: Stream = None) -> Iterator[str]:
    """Run ``asnackq sink --db DB OPTIONS`` and yield its URL; stopped (SIGTERM) on exit.

    The sink's log (one line per refusal) goes to ``stderr``, by default this process's.
    """
    with Replicas(db, 1, *options, stderr=stderr) as sinks:
        yield sinks.urls[0]


def sink_stats(url: str, ca_file: Path | None = None) -> dict[str, int]:
    """The sink's counters (``GET /stats`` next to its ``/events`` URL; for https, the
    certificate is verified with ``ca_file``'s CAs, or the system's)."""
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    stats_url = url.rsplit("/", 1)[0] + "/stats"
    with urllib.request.urlopen(stats_url, timeout=10, context=context) as answer:
        stats: dict[str, int] = json.load(answer)
    return stats


class Replicas:
    """K ``asnackq sink`` processes sharing one DB; one can be SIGKILLed and restarted on
    its port (its clients keep their URL).  ``with Replicas(...) as sinks:`` stops them all
    and keeps their exit codes in ``codes``.

    ``counters()`` sums every incarnation's: a replica is read once more just before its
    SIGKILL, so a killed incarnation's counters are known up to that reading (what it
    counted between that reading and the kill - milliseconds - is not); a live one's are
    exact at each reading.
    """

    def __init__(
        self,
        db: Target,
        count: int,
        *options: object,
        stderr: Stream = None,
        ca_file: Path | None = None,
    ) -> None:
        self.db, self.count, self.options, self.stderr = db, count, options, stderr
        self.ca_file = ca_file  # an https sink's CA, for its counters
        self.procs: list[Proc] = []
        self.urls: list[str] = []
        self.codes: list[int] = []
        self.kills = 0
        self.gone: dict[str, int] = {}  # the killed incarnations' counters, at their last reading
        self.read: list[dict[str, int]] = []  # each live incarnation's last reading

    def __enter__(self) -> Replicas:
        try:
            for _ in range(self.count):
                self._start(0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, port: int | str, n: int | None = None) -> None:
        proc, url = start_sink(self.db, *self.options, port=port, stderr=self.stderr)
        if n is None:
            self.procs.append(proc)
            self.urls.append(url)
            self.read.append({})
        else:
            self.procs[n] = proc
            self.read[n] = {}

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL a random replica, then start it again on the same port."""
        n = rng.randrange(self.count)
        with contextlib.suppress(OSError, ValueError):  # (unreadable: its last reading)
            self.read[n] = counters(sink_stats(self.urls[n], self.ca_file))
        kill(self.procs[n])
        self.kills += 1
        self.gone = add(self.gone, self.read[n])
        self._start(self.urls[n].rsplit(":", 1)[1].split("/")[0], n)

    def counters(self) -> dict[str, int]:
        """Every incarnation's counters summed: the live ones read now (see the class)."""
        self.read = [counters(sink_stats(url, self.ca_file)) for url in self.urls]
        totals = self.gone
        for read in self.read:
            totals = add(totals, read)
        return totals

    def __exit__(self, *exc: object) -> None:
        self.codes = stop(*self.procs)


def counters(stats: dict[str, int]) -> dict[str, int]:
    """A sink's counters from its ``/stats``: the stock is one shared value, not a counter."""
    return {key: value for key, value in stats.items() if key != "stock"}


def add(one: dict[str, int], two: dict[str, int]) -> dict[str, int]:
    """Two sets of counters added key by key (a new dict)."""
    return {key: one.get(key, 0) + two.get(key, 0) for key in one.keys() | two.keys()}


FINISHED = b'"e": "finish"'  # a trace line: a result committed (see asnackq.dispatch.traces)
STALE = b'"status": false'  # ... or refused by the fence (not a delivery)


@dataclass
class Workers:
    """An experiment's worker processes (``asnackq work ... --until-empty``, or with
    ``follow`` until stopped), each under a new owner name with its trace, output and errors
    in ``root``: started, SIGKILLed, replaced, reaped, stopped.  ``events`` records every
    start and kill (epoch ms)."""

    root: Path
    queue: Target
    urls: list[str]  # the sinks; worker N sends to urls[N % len(urls)]; none: the fleet
    options: Sequence[object]  # every worker's options (concurrency, lease, ...)
    place: Placement | None = None  # where worker N runs, with its own options
    follow: bool = False  # each runs until stopped, not until the queue is empty
    procs: dict[str, Proc] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    started: int = 0
    kills: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    reaped: set[str] = field(default_factory=set)
    # owners with a result committed -> when that was first seen (``perf_counter``)
    delivered: dict[str, float] = field(default_factory=dict)
    trace_read: dict[str, int] = field(default_factory=dict)  # bytes of each trace looked at

    def start(self, *extra: object) -> str:
        """Start one more worker (with ``extra`` options); return its owner name."""
        self.started += 1
        owner = f"lab-w{self.started}"
        prefix, own = self.place(self.started) if self.place else ((), ())
        self.events.append({"at": epoch_ms(), "e": "start", "owner": owner})
        with (
            open(self.root / f"{owner}.out", "w") as out,
            open(self.root / f"{owner}.err", "w") as err,
        ):
            self.procs[owner] = worker(
                self.queue,
                self.urls[self.started % len(self.urls)] if self.urls else None,
                "--owner",
                owner,
                "--trace",
                self.root / f"{owner}.trace",
                *(() if self.follow else ("--until-empty",)),
                "--json",
                *self.options,
                *own,
                *extra,
                prefix=prefix,
                stdout=out,
                stderr=err,
            )
        return owner

    def killed(self, owner: str) -> None:
        """Record the SIGKILL ``owner`` died of."""
        self.reaped.add(owner)
        self.events.append({"at": epoch_ms(), "e": "kill", "owner": owner})
        self.kills += 1

    def kill_one(self, rng: random.Random, served_s: float = 0.0) -> bool:
        """SIGKILL a random live worker that has delivered, ``served_s`` ago or longer, and
        start a new one (it reclaims the leases later); False if there is none yet.

        A worker is never the victim before its first delivery is committed (a ``finish``
        line in its trace): on a slow machine a start and a first round trip can take longer
        than the kill period, and killing workers that never got to deliver would stop all
        progress, so every kill follows some.  ``served_s`` (the kill period, given by
        ``Kills``) makes that some a period's work, not one delivery: a fleet's worker serves
        every endpoint, and one killed at its first delivery would leave the others its
        leases to wait out and nothing done.  Every such worker is a victim alike, whether
        or not it holds work: a choice among the workers holding leases would follow the
        work, killing, near the end of a run, the one worker that took up the last jobs each
        time it does.
        """
        now = time.perf_counter()
        live = sorted(
            owner
            for owner, proc in self.procs.items()
            if proc.poll() is None
            and self.has_delivered(owner)
            and now - self.delivered[owner] >= served_s
        )
        if not live:
            return False
        victim = rng.choice(live)
        kill(self.procs[victim])
        self.killed(victim)
        self.start()
        return True

    def has_delivered(self, owner: str) -> bool:
        """Whether ``owner`` has committed a delivery's result since it started (a ``finish``
        line with a status in its trace; the trace is read on from where the last look left
        off, whole lines only)."""
        if owner in self.delivered:
            return True
        read = self.trace_read.get(owner, 0)
        try:
            with open(self.root / f"{owner}.trace", "rb") as trace:
                trace.seek(read)
                chunk = trace.read()
        except FileNotFoundError:
            return False
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.trace_read[owner] = read + len(whole)
        if any(FINISHED in line and STALE not in line for line in whole.splitlines()):
            self.delivered[owner] = time.perf_counter()
        return owner in self.delivered

    def exited(self) -> list[tuple[str, int]]:
        """The workers that exited since the last call (reaped), with their exit codes; an
        exit other than 0 or SIGKILL is recorded in ``failures`` with the end of its errors."""
        ended = [
            (owner, code)
            for owner, proc in self.procs.items()
            if owner not in self.reaped and (code := proc.poll()) is not None
        ]
        for owner, code in ended:
            reap(self.procs[owner])
            self.reaped.add(owner)
            if code not in (0, -signal.SIGKILL):
                error = (self.root / f"{owner}.err").read_text(errors="replace").strip()
                self.failures[owner] = f"{owner} exited {code}: {error[-300:]}"
        return ended

    @property
    def running(self) -> bool:
        """Whether a worker has not been seen to exit yet."""
        return len(self.reaped) < len(self.procs)

    def stop(self) -> None:
        """Stop every worker still running (SIGTERM, then SIGKILL after ``STOP_S``)."""
        stop(*self.procs.values())


@dataclass
class Kills:
    """SIGKILLs on a period: ``every`` seconds (0: never) a worker that has delivered for a
    period since it started (``Workers.kill_one``, which starts its replacement), or, given
    ``sinks``, every other time a sink replica (restarted on its port).  ``due`` is the
    first kill's time (``perf_counter``); a period with no worker to kill yet waits for
    one."""

    workers: Workers
    every: float
    rng: random.Random
    due: float
    sinks: Replicas | None = None

    def __call__(self, now: float) -> None:
        """Kill one if a kill is due at ``now`` (``perf_counter``)."""
        if not self.every or now < self.due:
            return
        if self.sinks is not None and (self.workers.kills + self.sinks.kills) % 2:
            self.sinks.kill_one(self.rng)
        elif not self.workers.kill_one(self.rng, served_s=self.every):
            return  # at a later look, once one has delivered
        self.due = now + self.every


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within: SIGTERM raises ``SystemExit(143)`` (the children's ``finally`` runs).

    Only the main thread can install a handler; elsewhere this changes nothing.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
