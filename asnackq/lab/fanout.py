"""``asnackq lab --endpoints N``: events fanned out to N endpoints, each a receiver process
of its own (``asnackq.lab.receiver``) with its own secret and fault, served by worker
processes running ``asnackq work QUEUE`` (the fleet: every endpoint of the queue); then
verdicts per endpoint from the evidence (the queue and each receiver's own file).

Rules of this module:

* The queue is a file in the run's directory, a ``postgresql://`` URL holding no jobs and no
  endpoints yet (``db``), or a throwaway local server (``pg_local``,
  ``asnackq.lab.pg_server``).  Each receiver keeps its own SQLite file: an endpoint is a
  service of its own, not a table of the queue's database.
* Workers are ``procs.Workers`` (following the queue until stopped); ``kill_every`` SIGKILLs
  one of them that has delivered since it started, and starts its replacement
  (``procs.Kills``, the lab's one kill loop).  Its leased deliveries wait out their lease,
  then another worker claims them: the verdicts hold through every kill.

* A fault is ``NAME:KIND[:ARG]`` (``parse_fault``): ``down:AT:FOR`` the receiver is
  SIGKILLed AT seconds after the first events are enqueued and started again on its port
  FOR seconds later; ``slow:MS`` each answer MS ms late; ``429:RATE`` / ``503:RATE``
  that share (below 1) of requests refused; ``410:AFTER`` one ``410 Gone`` after AFTER applied
  deliveries: the worker disables the endpoint, its deliveries wait, and the lab (as an
  operator would) enables it again ``GONE_HOLD_S`` after seeing it disabled; ``twice`` a
  receiver whose effect applies each delivery twice (the lab's self-check: a verdict must
  fail).  An endpoint with no fault is *healthy*.
* Events are enqueued at ``EVENTS_PER_S`` (each with a key of ``KEYS``), so a healthy
  endpoint's latency measures its own service, not a backlog made on purpose.
* Verdicts, each endpoint's: ``nothing-lost`` (every event applied there, its delivery
  done); ``fanned-out`` (every event has a delivery there; not judged of a 410 endpoint,
  which takes no event enqueued while it is disabled); ``applied-once`` (one ``applied``
  row per event); ``in-order`` (an ordered
  endpoint: each key's events applied in enqueue order); ``healthy-bound`` (a healthy
  endpoint: every delivery applied within ``bound_s`` of its enqueue, default
  ``HEALTHY_BOUND_S``); ``gone-reenabled`` (a 410 endpoint: it was disabled, then enabled).
* The healthy bound is absolute, judged per delivery from this run alone: a ratio against
  a clean run would compare two moments of a machine whose load moves, and kills land
  differently in each (docs/lab.md).  With kills, the bound given must cover them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint, Exponential, plan_list
from asnackq.lab.experiment import require_empty
from asnackq.lab.pg_server import local_server
from asnackq.lab.procs import Kills, Workers, exit_on_sigterm
from asnackq.store import readers, sessions
from asnackq.store.outage import database_error
from asnackq.store.targets import Target, is_url
from asnackq.wire import webhooks as wh
from asnackq.wire.send import check_number

__all__ = ["FAULTS", "HEALTHY_BOUND_S", "VERDICTS", "FanoutConfig", "parse_fault", "run_fanout"]

FAULTS = {
    "down": r"down:\d+(\.\d+)?:\d+(\.\d+)?",
    "slow": r"slow:\d{1,5}",
    "429": r"429:0(\.\d+)?",  # below 1: an endpoint that never takes one is down:
    "503": r"503:0(\.\d+)?",  # its deliveries would outlast any run
    "410": r"410:\d{1,7}",
    "twice": r"twice",
}
HEALTHY_BOUND_S = 10.0  # wide: a busy 2-core machine runs every process of the lab
EVENTS_PER_S = 50
KEYS = 10
GONE_HOLD_S = 1.0
STOP_WAIT_S = 30.0
STARTUP_S = 60.0
STARTED = "asnackq work: started"
LOOK_S = 0.05  # how often the kill loop reaps the workers that exited and kills one if due
SQL_DELIVERIES = """SELECT d.endpoint, d.event, j.status FROM asnackq_deliveries AS d
  JOIN jobs AS j ON j.id = d.job"""
SQL_APPLIED = "SELECT event_id, key, n, applied_ms FROM applied ORDER BY seq"


def parse_fault(text: str) -> tuple[str, str]:
    """``NAME:KIND[:ARG]`` as (name, fault); a ``ValueError`` in one line if it is none."""
    name, _, fault = text.partition(":")
    w.check_identifier(name, "endpoint name")
    if not any(re.fullmatch(pattern, fault) for pattern in FAULTS.values()):
        raise ValueError(
            f"--endpoint-fault {text!r}: give NAME:KIND[:ARG], KIND one of down:AT:FOR, "
            "slow:MS, 429:RATE, 503:RATE, 410:AFTER, twice"
        )
    return name, fault


@dataclass
class FanoutConfig:
    """One fan-out run's settings; ``check`` refuses bad ones before anything starts."""

    endpoints: int = 3
    events: int = 200
    processes: int = 2
    faults: dict[str, str] = field(default_factory=dict)
    ordered: tuple[str, ...] = ()
    bound_s: float = HEALTHY_BOUND_S
    lease_ms: int = 2000
    timeout_s: float = 300.0
    seed: int = 1
    db: str | None = None  # a postgresql:// URL holding no jobs yet: the queue there
    pg_local: bool = False  # the queue on a throwaway local server
    kill_every: float = 0.0  # SIGKILL a worker that has delivered this often (0: never)

    @property
    def names(self) -> list[str]:
        return [f"ep{i}" for i in range(self.endpoints)]

    def check(self) -> None:
        w.check_int(self.endpoints, "endpoints", 1, 64)
        w.check_int(self.events, "jobs", 1, 1_000_000)
        w.check_int(self.processes, "processes", 1, 64)
        w.check_int(self.lease_ms, "lease_ms", 1000, w.PRODUCT.lease_ms)
        for name in (*self.faults, *self.ordered):
            if name not in self.names:
                raise ValueError(f"no endpoint {name!r}: the lab's are ep0..ep{self.endpoints - 1}")
        if not 0 < self.bound_s <= 3600 or not 0 < self.timeout_s <= 86_400:
            raise ValueError("--healthy-bound-s must be in (0, 3600], --timeout-s in (0, 86400]")
        check_number(self.kill_every, "kill_every", 0, 3600)
        if self.db is not None and not is_url(self.db):
            raise ValueError("--db must be a postgresql:// URL (files live in --dir)")
        if self.db is not None and self.pg_local:
            raise ValueError("--db and --pg-local do not go together")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner alone (mode 0600)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
        file.write(text)


@dataclass
class Receiver:
    """One endpoint's receiver process, its file and its port (kept across a restart)."""

    name: str
    db: Path
    secret: str = field(repr=False)
    fault: str
    seed: int
    port: int = 0
    process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start the process; its secret goes in a file only its owner reads (a process's
        arguments are anyone's to see)."""
        secret_file = self.db.with_suffix(".secret")
        write_private(secret_file, self.secret + "\n")
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asnackq.lab.receiver", "--db", str(self.db),
            "--port", str(self.port), "--secret-file", str(secret_file), "--fault", self.fault,
            "--seed", str(self.seed), stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), STOP_WAIT_S)
        self.port = json.loads(line)["port"]

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), STOP_WAIT_S)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"


@contextlib.asynccontextmanager
async def receivers(config: FanoutConfig, root: Path) -> AsyncIterator[dict[str, Receiver]]:
    """Every endpoint's receiver, started; all stopped on exit."""
    started = {
        name: Receiver(name, root / f"{name}.db", wh.new_secret(), config.faults.get(name, "none"),
                       config.seed + i)
        for i, name in enumerate(config.names)
    }  # fmt: skip
    try:
        for receiver in started.values():
            await receiver.start()
        yield started
    finally:
        for receiver in started.values():
            await receiver.stop()


async def started(workers: Workers) -> None:
    """Wait until each live worker said it started: events enqueued before would time its
    start-up, not its deliveries, and a SIGTERM before would find no handler yet."""
    deadline = time.monotonic() + STARTUP_S
    for owner in [owner for owner, proc in workers.procs.items() if proc.poll() is None]:
        log = workers.root / f"{owner}.err"
        while STARTED not in log.read_text(errors="replace"):
            if time.monotonic() > deadline or workers.procs[owner].poll() is not None:
                raise RuntimeError(f"worker {owner} did not start within {STARTUP_S}s: see {log}")
            await asyncio.sleep(0.05)


async def killing(workers: Workers, kills: Kills) -> None:
    """Until cancelled: reap the workers that exited (an exit but 0 or SIGKILL is a
    failure), and kill one when a kill is due."""
    while True:
        await asyncio.sleep(LOOK_S)
        workers.exited()
        kills(time.perf_counter())


def deliveries(queue: Target) -> dict[str, dict[str, str]]:
    """Each endpoint's deliveries: event id -> its job's status."""
    with readers.read_only(queue, "jobs") as con:
        found: dict[str, dict[str, str]] = {}
        for endpoint, event, status in con.execute(SQL_DELIVERIES):
            found.setdefault(endpoint, {})[event] = status
        return found


def by_status(events: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in events.values():
        counts[status] = counts.get(status, 0) + 1
    return counts


def settled(found: dict[str, dict[str, str]]) -> bool:
    """Whether every delivery of every endpoint ended (done or dead)."""
    return all(s in ("done", "dead") for events in found.values() for s in events.values())


async def enqueue(queue: AsyncQueue, config: FanoutConfig, enqueued: dict[str, int]) -> None:
    """The events, at ``EVENTS_PER_S`` in batches of a tenth of a second's."""
    batch = max(1, EVENTS_PER_S // 10)
    for start in range(0, config.events, batch):
        at = w.epoch_ms()
        events = [
            {"id": f"ev-{i:07d}", "type": "lab.event", "key": f"k{i % KEYS}",
             "data": {"n": i, "key": f"k{i % KEYS}"}}
            for i in range(start, min(start + batch, config.events))
        ]  # fmt: skip
        await queue.enqueue_many(events)
        enqueued.update((str(event["id"]), at) for event in events)
        await asyncio.sleep(0.1)


@dataclass
class Watch:
    """What the lab did while the run went on: downs, 410s seen and enablings."""

    events: list[dict[str, Any]] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)

    def note(self, what: str, name: str, t0: float) -> None:
        self.events.append(
            {"at_s": round(time.monotonic() - t0, 3), "what": what, "endpoint": name}
        )


async def downs(found: dict[str, Receiver], watch: Watch, t0: float) -> None:
    """Each ``down:AT:FOR`` receiver killed at AT and started again FOR seconds later."""

    async def one(receiver: Receiver, at: float, hold: float) -> None:
        await asyncio.sleep(at)
        receiver.kill()
        watch.note("killed", receiver.name, t0)
        await asyncio.sleep(hold)
        await receiver.start()
        watch.note("restarted", receiver.name, t0)

    await asyncio.gather(
        *(
            one(r, float(r.fault.split(":")[1]), float(r.fault.split(":")[2]))
            for r in found.values()
            if r.fault.startswith("down:")
        )
    )


async def operator(queue: AsyncQueue, config: FanoutConfig, watch: Watch, t0: float) -> None:
    """Enable each 410 endpoint again ``GONE_HOLD_S`` after it is seen disabled."""
    waiting = {name for name, fault in config.faults.items() if fault.startswith("410:")}
    while waiting:
        for name in sorted(waiting):
            endpoint = await queue.endpoint(name)
            if endpoint.state == "disabled":
                watch.note(f"disabled: {endpoint.disabled_reason}", name, t0)
                await asyncio.sleep(GONE_HOLD_S)
                await queue.enable_endpoint(name)
                watch.note("enabled", name, t0)
                watch.gone.add(name)
                waiting.discard(name)
        await asyncio.sleep(0.1)


async def run(config: FanoutConfig, root: Path) -> dict[str, Any]:
    """The run: receivers, endpoints, workers, events, faults and kills; then the verdicts."""
    queue_at: Target = config.db or root / "queue.db"
    watch, enqueued = Watch(), dict[str, int]()
    t0 = time.monotonic()
    ttl_ms = round(config.timeout_s * 1000) + 60_000  # no delivery dies of the run's length
    async with (
        receivers(config, root) as found,
        AsyncQueue.open(queue_at, ttl_ms=ttl_ms, max_attempts=16) as queue,
    ):
        await add_endpoints(queue, found, config)
        workers = Workers(root, queue_at, [], ("--lease-ms", config.lease_ms), follow=True)
        try:
            for _ in range(config.processes):
                workers.start()
            await started(workers)
            kills = Kills(
                workers, config.kill_every, random.Random(config.seed),
                time.perf_counter() + config.kill_every,
            )  # fmt: skip
            tasks = [
                asyncio.ensure_future(coro)
                for coro in (
                    enqueue(queue, config, enqueued),
                    downs(found, watch, t0),
                    operator(queue, config, watch, t0),
                )
            ]
            killer = asyncio.ensure_future(killing(workers, kills))
            timed_out = not await until_settled(config, queue_at, t0, tasks)
            for task in (*tasks, killer):
                task.cancel()
            ended = await asyncio.gather(*tasks, killer, return_exceptions=True)
            with contextlib.suppress(RuntimeError):  # (one that never started: its exit says)
                await started(workers)  # the last replacement, then each stopped cleanly
        finally:
            await asyncio.to_thread(workers.stop)
        workers.exited()
    failed = [f"lab: {e!r}" for e in ended if isinstance(e, Exception)]  # (not cancellations)
    applied = {name: applied_rows(r.db) for name, r in found.items()}
    result = judge(config, enqueued, deliveries(queue_at), applied, watch, timed_out)
    result["violations"] += [f"workers-exit: {why}" for why in workers.failures.values()]
    result["violations"] += failed  # a receiver that did not start again, an intake refused
    return result | {
        "seconds": round(time.monotonic() - t0, 3),
        "lab_events": watch.events,
        "kills": workers.kills,
        "workers_started": workers.started,
    }


async def add_endpoints(
    queue: AsyncQueue, found: dict[str, Receiver], config: FanoutConfig
) -> None:
    """Each receiver an endpoint of the queue, with its secret (its ACK the success)."""
    for name, receiver in found.items():
        ordered = name in config.ordered
        await queue.add_endpoint(
            Endpoint(name, receiver.url, secrets=((receiver.secret, None),), success="ack",
                     concurrency=1 if ordered else "auto", ordered=ordered, timeout_s=5.0,
                     retry=Exponential(50, 1000))
        )  # fmt: skip


async def until_settled(
    config: FanoutConfig, queue: Target, t0: float, first: list[asyncio.Task[None]]
) -> bool:
    """Wait until ``first`` (the intake, the downs, the operator) ended, then every delivery;
    False at ``timeout_s``.  A read that fails (a killed worker's journal, a server away)
    is tried again at the next look."""
    while time.monotonic() - t0 < config.timeout_s:
        await asyncio.sleep(0.2)
        if not all(task.done() for task in first):
            continue
        try:
            if settled(await asyncio.to_thread(deliveries, queue)):
                return True
        except Exception as error:
            if not database_error(error):
                raise
    return False


def applied_rows(db: Path) -> list[tuple[str, str, int, int]]:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return [tuple(row) for row in con.execute(SQL_APPLIED)]


def judge(
    config: FanoutConfig,
    enqueued: dict[str, int],
    found_deliveries: dict[str, dict[str, str]],
    applied: dict[str, list[tuple[str, str, int, int]]],
    watch: Watch,
    timed_out: bool,
) -> dict[str, Any]:
    """Each endpoint's verdicts (name -> True or a reason), and the violations in a list."""
    verdicts: dict[str, dict[str, Any]] = {}
    for name in config.names:
        rows, fault = applied[name], config.faults.get(name)
        verdicts[name] = {
            "fault": fault,
            "ordered": name in config.ordered,
            "deliveries": by_status(found_deliveries.get(name, {})),
            "applied_rows": len(rows),
            **endpoint_verdicts(
                config, name, enqueued, found_deliveries.get(name, {}), rows, watch
            ),
        }
    violations = [
        f"{name}: {check}: {reason}"
        for name, found in verdicts.items()
        for check, reason in found.items()
        if check in VERDICTS and reason is not True
    ]
    if timed_out:
        violations.append(f"in-time: the run did not end within {config.timeout_s}s")
    return {"endpoints": verdicts, "violations": violations, "bound_s": config.bound_s}


VERDICTS = (
    "nothing-lost",
    "applied-once",
    "fanned-out",
    "in-order",
    "healthy-bound",
    "gone-reenabled",
)


def endpoint_verdicts(
    config: FanoutConfig,
    name: str,
    enqueued: dict[str, int],
    statuses: dict[str, str],
    rows: list[tuple[str, str, int, int]],
    watch: Watch,
) -> dict[str, Any]:
    """One endpoint's verdicts: True, or the reason it fails."""
    ids = [row[0] for row in rows]
    missing = set(statuses) - set(ids)
    undone = sum(status != "done" for status in statuses.values())
    twice = len(ids) - len(set(ids))
    found: dict[str, Any] = {
        "nothing-lost": True
        if not missing and not undone and len(enqueued) == config.events
        else f"{len(missing)} deliveries not applied, {undone} not done",
        "applied-once": True if not twice else f"{twice} deliveries applied more than once",
    }
    if name in config.ordered:
        found["in-order"] = in_order(rows)
    fault = config.faults.get(name)
    if fault is None:
        late = [e for e, _, _, at in rows if at - enqueued.get(e, at) > config.bound_s * 1000]
        found["healthy-bound"] = (
            True if not late else f"{len(late)} applied after {config.bound_s}s"
        )
        found["latency_ms"] = latency(rows, enqueued)
    if fault is None or not fault.startswith("410:"):
        # every event fanned out to it (a disabled endpoint takes none of those enqueued
        # while it is disabled: the 410 endpoint's are its deliveries)
        found["fanned-out"] = (
            True
            if set(statuses) == set(enqueued)
            else (f"{len(set(enqueued) - set(statuses))} events have no delivery to it")
        )
    else:
        found["gone-reenabled"] = True if name in watch.gone else "never disabled by its 410"
    return found


def in_order(rows: list[tuple[str, str, int, int]]) -> Any:
    """True if each key's events were applied in enqueue order (``n`` rising)."""
    last: dict[str, int] = {}
    for event_id, key, n, _ in rows:
        if n < last.get(key, -1):
            return f"{event_id} (key {key}) applied after a later event of its key"
        last[key] = n
    return True


def latency(rows: list[tuple[str, str, int, int]], enqueued: dict[str, int]) -> dict[str, int]:
    """Enqueue-to-applied latency: p50, p99 and max, in ms."""
    spans = sorted(at - enqueued[e] for e, _, _, at in rows if e in enqueued)
    if not spans:
        return {}
    at = [spans[min(len(spans) - 1, int(q * len(spans)))] for q in (0.5, 0.99)]
    return {"p50": at[0], "p99": at[1], "max": spans[-1]}


def require_fresh(db: str) -> None:
    """``db`` holds no jobs, no inbox rows and no endpoints yet (``ValueError`` if it does:
    the lab's events would go to those endpoints too)."""
    require_empty(db)
    try:
        with sessions.pg_read_only(db, "jobs", "queue") as reader:
            found = cast(sessions.Session, reader).run(plan_list)
    except ValueError:
        return  # (no queue there yet)
    if found:
        raise ValueError(
            f"--db must hold no endpoints yet ({len(found)} there): give a fresh database"
        )


def run_fanout(config: FanoutConfig, root: Path) -> dict[str, Any]:
    """Check ``config`` (and that its ``db`` holds no jobs and no endpoints yet), then run
    it with its files in ``root`` (made).  A SIGTERM ends it like Ctrl-C: every child
    process, and a ``pg_local`` server, is stopped first."""
    config.check()
    if config.db is not None:
        require_fresh(config.db)
    root.mkdir(parents=True, exist_ok=True)
    with exit_on_sigterm(), contextlib.ExitStack() as stack:
        if config.pg_local:
            server = stack.enter_context(local_server())
            config = dataclasses.replace(config, db=server.url(), pg_local=False)
        return asyncio.run(run(config, root))
