"""Endpoints under one Fleet: noisy neighbours, fairness behind a backlog, a hundred endpoints,
order per key through SIGKILLs.

    python benchmarks/endpoints.py [--scenario noisy,fairness,scale,order] [--quick] [--json]
                                   [--events N] [--rounds N] [--backlog N] [--fanout-events N]
                                   [--keys N] [--per-key N] [--dir DIR]

Every scenario runs on a SQLite file of its own, with the Fleet (``asnackq.aio.Fleet``) in
this process and real aiohttp receivers on 127.0.0.1 port 0 (in this process; for noisy, in
a child process of their own); each receiver verifies every request's Standard Webhooks
signature and keeps when it arrived (the ACK follows at once).  Latency is enqueue-to-ACK:
from just before the ``enqueue_many`` that made an event to the arrival of its request.
Each ratio is of two measurements taken in the same run:

* noisy: 10 endpoints, one never answers (``timeout_s`` 1), one answers 503, 8 healthy;
  ``--events`` events fanned out to all once the Fleet serves every endpoint.  Targets: the
  8 healthy endpoints' goodput >= 0.9 x theirs in the same run without the two bad ones,
  their p99 latency <= 2 x, and the bad endpoints' deliveries spend no attempt beyond the
  breaker's probes (none with more than one attempt: the probes are re-sends of the
  deliveries in flight when the breaker opened).  The fleet's process is CPU-bound, so its
  goodput is the share of a core it gets over its CPU per delivery: the receivers run
  apart (their CPU is not the fleet's), and ``--rounds`` rounds run both configurations
  in alternating order (clean then noisy, noisy then clean, ...) so that a machine's load
  that drifts meets both alike.  The fleet's CPU per healthy delivery and its share of a
  core are shown beside the ratio: the first does not depend on the machine's load.
* fairness: endpoint A holds a backlog of ``--backlog`` events, then B receives 200, one
  every 10 ms.  Target: B's p99 enqueue-to-ACK latency <= 2 x its p99 with A idle.
* scale: 100 endpoints, ``--fanout-events`` events fanned out to 2 each (``to=``).  Target:
  deliveries per second >= 0.8 x one endpoint's, measured on the same number of deliveries.
* order (run only when named): ``--keys`` keys x ``--per-key`` events (500 x 20), the keys
  interleaved at random, enqueued while two ``python -m asnackq work QUEUE`` children (each
  a Fleet) serve two ordered endpoints, one at concurrency "auto", one at 16, each sent every
  event.  Their receivers answer a fifth of the requests 500 or 503 at random before reading
  them; the rest go to a ``WebhookReceiver`` per endpoint (the signature verified, each
  event applied once in an inbox on a file of its own, the applied rows in the order
  applied).  One child is SIGKILLed once a third of the deliveries are applied, the other
  at two thirds, each started again at once.  Target: every key's events applied in
  enqueue order, each once, at both endpoints (read from the receivers' rows; duplicates
  the inboxes absorbed are counted, not applied).  Its ratio is the share of the keys'
  sequences that hold (at both endpoints), not of two measurements; the Fleets are the
  children's, the receivers this process's.

``--quick`` runs each scenario tiny (a check that the script runs, not a measurement).
``--json`` prints one JSON line of every figure after the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import sqlite3
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import aiohttp
import aiosqlite
from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from asnackq.aio import AsyncQueue, Fleet
from asnackq.core.endpoints import Delays, Endpoint
from asnackq.dispatch.events import Event
from asnackq.http_sink import WebhookReceiver
from asnackq.wire import webhooks as wh

SECRET = wh.new_secret()
WAIT_S = 600.0  # a bound on every wait


class Receivers:
    """One aiohttp app serving ``/hook/{name}``: each name answers as ``behaviour[name]``
    says (204, 503, or "silent": never, until the app stops), after verifying the signature;
    ``arrived[name][webhook-id]`` is the first arrival (monotonic s)."""

    def __init__(self, secret: str = SECRET) -> None:
        self.verifier = Webhook(secret)
        self.behaviour: dict[str, int | str] = {}
        self.arrived: dict[str, dict[str, float]] = {}
        self.requests: dict[str, int] = {}
        self.refused = 0
        self.gate = asyncio.Event()
        self.watch: tuple[Callable[[], bool], asyncio.Event] | None = None
        self.base = ""

    def add(self, name: str, behaviour: int | str = 204) -> str:
        self.behaviour[name] = behaviour
        self.arrived[name], self.requests[name] = {}, 0
        return f"{self.base}/hook/{name}"

    async def handle(self, request: web.Request) -> web.Response:
        at = time.monotonic()
        name = request.match_info["name"]
        body = await request.read()
        try:
            self.verifier.verify(body, {k.lower(): v for k, v in request.headers.items()})
        except WebhookVerificationError:
            self.refused += 1
            return web.Response(status=401)
        self.requests[name] += 1
        behaviour = self.behaviour[name]
        if behaviour == "silent":
            await self.gate.wait()
            return web.Response(status=204)
        if behaviour == 204:
            self.arrived[name].setdefault(request.headers["webhook-id"], at)
            if self.watch is not None and self.watch[0]():
                self.watch[1].set()
        return web.Response(status=int(behaviour))

    async def until(self, check: Callable[[], bool]) -> None:
        """Return once ``check()`` holds (looked at on each arrival)."""
        done = asyncio.Event()
        self.watch = (check, done)
        try:
            if not check():
                await asyncio.wait_for(done.wait(), WAIT_S)
        finally:
            self.watch = None

    async def until_asked(self, request: web.Request) -> web.Response:
        """``POST /until {"names", "count"}``: answers once the names' arrivals reach count."""
        asked = await request.json()
        names, count = asked["names"], asked["count"]
        await self.until(lambda: sum(len(self.arrived[n]) for n in names) >= count)
        return web.json_response({})

    async def report(self, request: web.Request) -> web.Response:
        """``GET /report``: every arrival, request count and refusal so far."""
        return web.json_response(
            {"arrived": self.arrived, "requests": self.requests, "refused": self.refused}
        )


@contextlib.asynccontextmanager
async def receivers(secret: str = SECRET) -> AsyncIterator[Receivers]:
    hooks = Receivers(secret)
    app = web.Application()
    app.router.add_post("/hook/{name}", hooks.handle)
    app.router.add_post("/until", hooks.until_asked)
    app.router.add_get("/report", hooks.report)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    hooks.base = f"http://127.0.0.1:{port}"
    try:
        yield hooks
    finally:
        hooks.gate.set()
        await runner.cleanup()


class Apart:
    """``Receivers`` in a child process (``receivers_apart``): the fleet's process spends
    no CPU on them.  Their arrival times are the child's ``time.monotonic()``, the
    machine's CLOCK_MONOTONIC: the same clock as this process's."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base, self.session = base, session

    def url(self, name: str) -> str:
        return f"{self.base}/hook/{name}"

    async def until(self, names: list[str], count: int) -> None:
        """Return once ``names`` together had ``count`` deliveries arrive."""
        async with self.session.post("/until", json={"names": names, "count": count}) as got:
            got.raise_for_status()

    async def report(self) -> dict[str, Any]:
        """``arrived`` (name -> webhook-id -> monotonic s), ``requests``, ``refused``."""
        async with self.session.get("/report") as got:
            got.raise_for_status()
            report: dict[str, Any] = await got.json()
            return report


@contextlib.asynccontextmanager
async def receivers_apart(behaviours: dict[str, int | str]) -> AsyncIterator[Apart]:
    """Receivers answering as ``behaviours`` says, in a child process (this script with
    ``--receivers``) that ends when its stdin closes."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--receivers",
        json.dumps({"secret": SECRET, "behaviours": behaviours}),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        base = (await asyncio.wait_for(child.stdout.readline(), 60)).decode().strip()
        if not base.startswith("http://"):
            raise RuntimeError("the receivers' process did not start")
        timeout = aiohttp.ClientTimeout(total=WAIT_S)
        async with aiohttp.ClientSession(base, timeout=timeout) as session:
            yield Apart(base, session)
    finally:
        child.stdin.close()
        try:
            await asyncio.wait_for(child.wait(), 30)
        except TimeoutError:
            child.kill()
            await child.wait()


async def serve_apart(secret: str, behaviours: dict[str, int | str]) -> None:
    """The child of ``receivers_apart``: say its base URL, serve until stdin closes."""
    async with receivers(secret) as hooks:
        for name, behaviour in behaviours.items():
            hooks.add(name, behaviour)
        print(hooks.base, flush=True)
        await asyncio.to_thread(sys.stdin.readline)


@contextlib.asynccontextmanager
async def running(fleet: Fleet) -> AsyncIterator[None]:
    task = asyncio.ensure_future(fleet.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else float("nan")


def latencies(arrived: dict[str, float], enqueued: dict[str, float]) -> list[float]:
    return [arrived[i] - enqueued[i] for i in arrived if i in enqueued]


async def enqueue(
    queue: AsyncQueue,
    ids: list[str],
    enqueued: dict[str, float],
    kind: str | None = None,
    to: list[str] | None = None,
    batch: int = 1000,
) -> None:
    """Enqueue events ``ids`` in transactions of ``batch``, noting when each was made."""
    for start in range(0, len(ids), batch):
        chunk = ids[start : start + batch]
        items = [{"id": i, "data": {"n": i}, **({"type": kind} if kind else {})} for i in chunk]
        at = time.monotonic()
        await queue.enqueue_many(items, to=to)
        enqueued.update(dict.fromkeys(chunk, at))


# --- noisy neighbours ---------------------------------------------------------------------

HEALTHY = [f"h{i}" for i in range(8)]
BAD: dict[str, int | str] = {"silent": "silent", "failing": 503}


async def noisy_phase(path: Path, events: int, bad: bool) -> dict[str, Any]:
    """One configuration's run: the 8 healthy endpoints (and the two bad ones, ``bad``),
    receivers in a child process, ``events`` fanned out to every endpoint once the
    Fleet serves them all; measured until the last healthy delivery arrived."""
    behaviours: dict[str, int | str] = {**dict.fromkeys(HEALTHY, 204), **(BAD if bad else {})}
    enqueued: dict[str, float] = {}
    async with receivers_apart(behaviours) as hooks, AsyncQueue.open(path) as queue:
        for name in behaviours:
            short = {"timeout_s": 1.0} if name in BAD else {}
            await queue.add_endpoint(Endpoint(name, hooks.url(name), secrets=(SECRET,), **short))
        want = events * len(HEALTHY)
        started = Started(len(behaviours))
        fleet = Fleet(queue, owner="bench", on_event=started.seen)
        count = transactions(queue)
        async with running(fleet):
            await asyncio.wait_for(started.all.wait(), WAIT_S)  # (a fleet serving, not starting)
            count[0], cpu, start = 0, cpu_s(), time.monotonic()
            await enqueue(queue, [f"e{i}" for i in range(events)], enqueued)
            await hooks.until(HEALTHY, want)
            cpu = cpu_s() - cpu
            paused = {n: d.paused for n, d in fleet.dispatchers().items()}
            counts = {n: d.snapshot() for n, d in fleet.dispatchers().items()}
        seen = await hooks.report()
    arrived: dict[str, dict[str, float]] = seen["arrived"]
    seconds = max(max(arrived[n].values()) for n in HEALTHY) - start
    out: dict[str, Any] = {
        "deliveries": want,
        "seconds": seconds,
        "cpu_s": cpu,
        "latencies": [x for n in HEALTHY for x in latencies(arrived[n], enqueued)],
        "refused": seen["refused"],
        "transactions": count[0],
        "cycles": sum(c.get("commits", 0) for c in counts.values()),
    }
    if bad:
        out["bad"] = {
            name: {"requests": seen["requests"][name], "paused": paused.get(name)}
            | {"cycles": counts.get(name, {}).get("commits", 0), **attempts(path, name)}
            for name in BAD
        }
    return out


class Started:
    """Set ``all`` once ``count`` Dispatchers said ``started`` (each endpoint's run is on)."""

    def __init__(self, count: int) -> None:
        self.count, self.all = count, asyncio.Event()

    def seen(self, event: Event) -> None:
        if event.name == "started":
            self.count -= 1
            if self.count == 0:
                self.all.set()


def cpu_s() -> float:
    """This process's CPU seconds (every thread's: the event loop's and SQLite's)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def attempts(path: Path, endpoint: str) -> dict[str, int]:
    """The endpoint's deliveries: how many were claimed, their attempts, the most of one."""
    with contextlib.closing(sqlite3.connect(path)) as con:
        rows = con.execute(
            "SELECT j.attempts FROM asnackq_deliveries AS d JOIN jobs AS j ON j.id = d.job"
            " WHERE d.endpoint = ?",
            (endpoint,),
        ).fetchall()
    spent = [a for (a,) in rows]
    return {
        "deliveries": len(spent),
        "claimed": sum(a > 0 for a in spent),
        "attempts": sum(spent),
        "max_attempts": max(spent, default=0),
    }


async def noisy(root: Path, size: dict[str, int]) -> list[dict[str, Any]]:
    """``size["rounds"]`` rounds of both configurations, their order alternating (clean
    first, then noisy first, ...): load that drifts meets each configuration alike.  Each
    configuration's goodput is its healthy deliveries over its measured seconds, all
    rounds together; each round's own ratio is shown."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(size["rounds"]):
        for bad in (False, True) if i % 2 == 0 else (True, False):
            name = f"{'noisy' if bad else 'clean'}{i}.db"
            runs[bad].append(await noisy_phase(root / name, size["events"], bad))
    clean, loud = (pooled(runs[bad]) for bad in (False, True))
    rounds = " ".join(
        f"{n['deliveries'] / n['seconds'] / (c['deliveries'] / c['seconds']):.2f}"
        for c, n in zip(runs[False], runs[True], strict=True)
    )
    bad = [b for run in runs[True] for b in run["bad"].values()]
    return [
        target(
            "noisy goodput",
            loud["goodput"] / clean["goodput"],
            ">=",
            0.9,
            f"{loud['goodput']:.0f} vs {clean['goodput']:.0f} deliveries/s over"
            f" {size['rounds']} rounds (each: {rounds}); the fleet's CPU per healthy"
            f" delivery {loud['cpu_ms']:.2f} vs {clean['cpu_ms']:.2f} ms, its share of a"
            f" core {loud['share']:.2f} vs {clean['share']:.2f}; transactions"
            f" {loud['transactions']} vs {clean['transactions']}, lane cycles"
            f" {loud['cycles']} vs {clean['cycles']}",
        ),
        target(
            "noisy p99",
            loud["p99_s"] / clean["p99_s"],
            "<=",
            2.0,
            f"{loud['p99_s'] * 1000:.0f} vs {clean['p99_s'] * 1000:.0f} ms",
        ),
        target(
            "noisy bad attempts/delivery (most)",
            max(b["max_attempts"] for b in bad),
            "<=",
            1,
            json.dumps([run["bad"] for run in runs[True]], sort_keys=True),
        ),
    ]


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's figures over its rounds."""
    deliveries = sum(r["deliveries"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    cpu = sum(r["cpu_s"] for r in runs)
    return {
        "goodput": deliveries / seconds,
        "p99_s": p99([x for r in runs for x in r["latencies"]]),
        "cpu_ms": 1000 * cpu / deliveries,
        "share": cpu / seconds,
        "transactions": sum(r["transactions"] for r in runs),
        "cycles": sum(r["cycles"] for r in runs),
    }


# --- fairness ------------------------------------------------------------------------------


async def fairness_phase(path: Path, backlog: int, b_events: int) -> dict[str, Any]:
    enqueued: dict[str, float] = {}
    async with receivers() as hooks, AsyncQueue.open(path) as queue:
        await queue.add_endpoint(Endpoint("a", hooks.add("a"), ("a.*",), (SECRET,)))
        await queue.add_endpoint(Endpoint("b", hooks.add("b"), ("b.*",), (SECRET,)))
        await enqueue(queue, [f"a{i}" for i in range(backlog)], {}, "a.x")
        fleet = Fleet(queue, owner="bench")
        async with running(fleet):
            if backlog:  # A is busy before B's first event
                await hooks.until(lambda: len(hooks.arrived["a"]) >= min(backlog, 500))
            a_before, start = len(hooks.arrived["a"]), time.monotonic()
            for i in range(b_events):
                await enqueue(queue, [f"b{i}"], enqueued, "b.x")
                await asyncio.sleep(0.01)
            await hooks.until(lambda: len(hooks.arrived["b"]) >= b_events)
            a_rate = (len(hooks.arrived["a"]) - a_before) / (time.monotonic() - start)
    return {
        "p99_s": p99(latencies(hooks.arrived["b"], enqueued)),
        "a_rate": a_rate,
        "a_left": backlog - len(hooks.arrived["a"]),
    }


async def fairness(root: Path, size: dict[str, int]) -> list[dict[str, Any]]:
    idle = await fairness_phase(root / "idle.db", 0, size["b_events"])
    busy = await fairness_phase(root / "backlog.db", size["backlog"], size["b_events"])
    return [
        target(
            "fairness B p99",
            busy["p99_s"] / idle["p99_s"],
            "<=",
            2.0,
            f"{busy['p99_s'] * 1000:.0f} vs {idle['p99_s'] * 1000:.0f} ms; A meanwhile "
            f"{busy['a_rate']:.0f}/s, {busy['a_left']} of its backlog left",
        ),
    ]


def transactions(queue: AsyncQueue) -> list[int]:
    """A counter of the transactions the queue's lanes ran (joint ones counted once): a
    profile of the queue's internals (``AsyncQueue._joint``), [0] if it has none."""
    count = [0]
    joint = getattr(queue, "_joint", None)
    if joint is not None:
        run = joint._run

        async def counted(make: Any) -> Any:
            count[0] += 1
            return await run(make)

        joint._run = counted
    return count


# --- scale ---------------------------------------------------------------------------------


async def scale_phase(path: Path, endpoints: int, events: int, fanout: int) -> tuple[float, str]:
    """Deliveries a second, and the lanes' cycles and the transactions they ran in."""
    names = [f"n{i}" for i in range(endpoints)]
    async with receivers() as hooks, AsyncQueue.open(path) as queue:
        for name in names:
            await queue.add_endpoint(Endpoint(name, hooks.add(name), secrets=(SECRET,)))
        groups: dict[tuple[str, ...], list[str]] = {}
        for i in range(events):
            pair = tuple(names[(i + k) % endpoints] for k in range(fanout))
            groups.setdefault(pair, []).append(f"e{i}")
        for pair, ids in groups.items():
            await enqueue(queue, ids, {}, to=list(pair))
        want = events * fanout
        start = time.monotonic()
        count = transactions(queue)
        summaries = await Fleet(queue, owner="bench").run(until_empty=True)
        got = sum(len(hooks.arrived[n]) for n in names)
        last = max(max(a.values()) for a in hooks.arrived.values() if a)
    if got != want or hooks.refused:
        raise RuntimeError(f"{got} of {want} deliveries arrived, {hooks.refused} refused")
    cycles = sum(summary.commits for summary in summaries.values())
    return want / (last - start), f"{cycles} lane cycles in {count[0]} transactions"


async def scale(root: Path, size: dict[str, int]) -> list[dict[str, Any]]:
    deliveries = 2 * size["fanout_events"]
    one, one_profile = await scale_phase(root / "one.db", 1, deliveries, 1)
    many, many_profile = await scale_phase(root / "many.db", 100, size["fanout_events"], 2)
    return [
        target(
            "scale deliveries/s",
            many / one,
            ">=",
            0.8,
            f"100 endpoints {many:.0f}/s vs 1 endpoint {one:.0f}/s, {deliveries} deliveries;"
            f" 100 endpoints: {many_profile}; 1 endpoint: {one_profile}",
        ),
    ]


# --- order ---------------------------------------------------------------------------------


# two ordered endpoints (name: concurrency), each sent every event
ORDERED: dict[str, int | Literal["auto"]] = {"o1": "auto", "o2": 16}
FAIL = 0.2  # the share of requests a receiver answers 500 or 503, before anything is read
ORDER_LEASE_MS = 2000  # (a killed worker's keys wait this long for their leases to end)
ORDER_RETRY = Delays((0, 50, 100, 200, 400) + (1000,) * 10)  # 16 attempts
APPLIED = """CREATE TABLE IF NOT EXISTS applied (seq INTEGER PRIMARY KEY,
  event TEXT NOT NULL, key TEXT NOT NULL, n INTEGER NOT NULL, at REAL NOT NULL)"""


async def record(con: aiosqlite.Connection, event: str, payload: Any) -> None:
    """The receivers' effect: a row per event applied, in the order applied, and when."""
    data = payload["data"]
    await con.execute(
        "INSERT INTO applied (event, key, n, at) VALUES (?, ?, ?, ?)",
        (event, data["key"], data["n"], time.monotonic()),
    )


class Inboxes:
    """``/hook/{name}``: ``FAIL`` of the requests answered 500 or 503 at random before their
    body is read; the others handled by ``name``'s ``WebhookReceiver`` (the signature
    verified, each event applied once, ``record``, in an inbox of its own file)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.inboxes: dict[str, WebhookReceiver[aiosqlite.Connection]] = {}
        self.requests = self.failed = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.rng.random() < FAIL:
            self.failed += 1
            return web.Response(status=self.rng.choice((500, 503)))
        return await self.inboxes[request.match_info["name"]].handle(request)

    def count(self, what: str) -> int:
        return sum(inbox.counts[what] for inbox in self.inboxes.values())

    def applied(self, n: int) -> Callable[[], bool]:
        """A check: have ``n`` events been applied?"""
        return lambda: self.count("applied") >= n


@contextlib.asynccontextmanager
async def inboxes(root: Path, names: list[str]) -> AsyncIterator[tuple[Inboxes, str]]:
    """The receivers (one app on 127.0.0.1 port 0) and their base URL."""
    hooks = Inboxes(seed=43)
    async with contextlib.AsyncExitStack() as stack:
        for name in names:
            con = await aiosqlite.connect(root / f"{name}-app.db", isolation_level=None)
            stack.push_async_callback(con.close)
            await con.execute_fetchall("PRAGMA journal_mode = WAL")
            await con.execute_fetchall(APPLIED)
            hooks.inboxes[name] = await WebhookReceiver.within(con, [SECRET], record, batch_max=64)
        app = web.Application()
        app.router.add_post("/hook/{name}", hooks.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield hooks, f"http://127.0.0.1:{runner.addresses[0][1]}"


class Workers:
    """``python -m asnackq work QUEUE`` children (each a Fleet serving every endpoint),
    killed with SIGKILL and started again on demand, stopped with SIGTERM at the end."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path, self.log = path, log
        self.children: list[asyncio.subprocess.Process] = []
        self.kills: list[int] = []  # how many events were applied at each kill

    async def start(self) -> asyncio.subprocess.Process:
        with self.log.open("ab") as err:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asnackq", "work", str(self.path),
                "--lease-ms", str(ORDER_LEASE_MS),
                stdout=asyncio.subprocess.DEVNULL, stderr=err,
            )  # fmt: skip

    async def kill_and_restart(self, index: int, applied: int) -> None:
        self.children[index].kill()
        await asyncio.wait_for(self.children[index].wait(), WAIT_S)
        self.kills.append(applied)
        self.children[index] = await self.start()

    async def stop(self) -> list[int | None]:
        for child in self.children:
            if child.returncode is None:
                child.terminate()
        return [await asyncio.wait_for(child.wait(), WAIT_S) for child in self.children]


async def polled(check: Callable[[], bool], what: str, workers: Workers) -> None:
    """Return once ``check()`` holds (looked at every 20 ms); fail if a worker ended."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        ended = [c.returncode for c in workers.children if c.returncode is not None]
        if ended or time.monotonic() > deadline:
            raise RuntimeError(f"not {what}: workers ended {ended}, see workers.log")
        await asyncio.sleep(0.02)


def interleaved(keys: int, per_key: int) -> list[dict[str, Any]]:
    """Every key's events in order, the keys interleaved at random."""
    turns = [f"k{k}" for k in range(keys) for _ in range(per_key)]
    random.Random(7).shuffle(turns)
    made: dict[str, int] = {}
    events = []
    for key in turns:
        n = made[key] = made.get(key, -1) + 1
        events.append({"id": f"{key}-{n}", "key": key, "data": {"key": key, "n": n}})
    return events


async def order_run(root: Path, keys: int, per_key: int) -> dict[str, Any]:
    path, names = root / "order.db", list(ORDERED)
    events = interleaved(keys, per_key)
    want = len(events) * len(names)
    async with inboxes(root, names) as (hooks, base), AsyncQueue.open(path) as queue:
        for name, limit in ORDERED.items():
            endpoint = Endpoint(
                name, f"{base}/hook/{name}", secrets=(SECRET,), concurrency=limit,
                retry=ORDER_RETRY, success="ack", ordered=True,
            )  # fmt: skip
            await queue.add_endpoint(endpoint)
        workers = Workers(path, root / "workers.log")
        start = time.monotonic()
        try:
            workers.children = [await workers.start(), await workers.start()]
            for batch in range(0, len(events), 500):
                await queue.enqueue_many(events[batch : batch + 500])
            for index in range(len(workers.children)):  # each killed once, mid-run
                await polled(hooks.applied(want * (index + 1) // 3), "applied", workers)
                await workers.kill_and_restart(index, hooks.count("applied"))
            await polled(hooks.applied(want), "all applied", workers)
            await polled(lambda: unfinished(path) == 0, "all done", workers)  # (leases let go)
        finally:
            codes = await workers.stop()
        return {
            "deliveries": want,
            "kills": workers.kills,
            "codes": codes,
            "requests": hooks.requests,
            "failed": hooks.failed,
            "duplicates": hooks.count("duplicates"),
            "applied": hooks.count("applied"),
            "start": start,
            **{name: receipts(root / f"{name}-app.db") for name in names},
            **queue_figures(path),
        }


def unfinished(path: Path) -> int:
    """The queue's pending and leased jobs."""
    with contextlib.closing(sqlite3.connect(path)) as con:
        [(count,)] = con.execute(
            "SELECT count(*) FROM jobs WHERE status IN ('pending', 'leased')"
        ).fetchall()
    return int(count)


class Receipts(NamedTuple):
    """What one receiver applied: each key's event numbers in the order applied; when the
    last one was (monotonic s)."""

    keys: dict[str, list[int]]
    last: float


def receipts(path: Path) -> Receipts:
    with contextlib.closing(sqlite3.connect(path)) as con:
        rows = con.execute("SELECT key, n, at FROM applied ORDER BY seq").fetchall()
    seen: dict[str, list[int]] = {}
    for key, n, _ in rows:
        seen.setdefault(key, []).append(n)
    return Receipts(seen, max((at for *_, at in rows), default=math.nan))


def queue_figures(path: Path) -> dict[str, Any]:
    """The deliveries' attempts and how each ended."""
    with contextlib.closing(sqlite3.connect(path)) as con:
        [(attempts,)] = con.execute("SELECT sum(attempts) FROM jobs").fetchall()
        statuses = dict(con.execute("SELECT status, count(*) FROM jobs GROUP BY status"))
    return {"attempts": attempts, "statuses": statuses}


async def order(root: Path, size: dict[str, int]) -> list[dict[str, Any]]:
    keys, per_key = size["keys"], size["per_key"]
    run = await order_run(root, keys, per_key)
    want = list(range(per_key))
    sequences = [run[name].keys.get(f"k{k}", []) for name in ORDERED for k in range(keys)]
    good = sum(ns == want for ns in sequences)
    shuffled = sum(sorted(ns) == want != ns for ns in sequences)
    each = ", ".join(
        f"{name} (concurrency {limit}) {keys * per_key / (run[name].last - run['start']):.0f}/s"
        for name, limit in ORDERED.items()
    )
    elapsed = max(run[name].last for name in ORDERED) - run["start"]  # to the last applied
    return [
        target(
            "order keys applied in order, once",
            good / len(sequences),
            ">=",
            1.0,
            f"{keys} keys x {per_key} events to {len(ORDERED)} ordered endpoints:"
            f" {run['deliveries']} deliveries in {elapsed:.1f} s"
            f" ({run['deliveries'] / elapsed:.0f}/s; {each});"
            f" {len(run['kills'])} workers SIGKILLed (at {run['kills']} applied) and restarted;"
            f" {run['attempts']} attempts, {run['requests']} requests, {run['failed']}"
            f" answered 500/503; {run['applied']} applied, {run['duplicates']} duplicates"
            f" absorbed by the inboxes; keys out of order {shuffled}, with an event missing or"
            f" twice {len(sequences) - good - shuffled}; jobs {run['statuses']}; the workers'"
            f" exit codes {run['codes']}",
        ),
    ]


# --- the run -------------------------------------------------------------------------------


def target(name: str, ratio: float, sense: str, bound: float, detail: str) -> dict[str, Any]:
    ok = ratio >= bound if sense == ">=" else ratio <= bound
    return {
        "target": name,
        "ratio": round(ratio, 3),
        "sense": sense,
        "bound": bound,
        "pass": ok,
        "detail": detail,
    }


SCENARIOS = {"noisy": noisy, "fairness": fairness, "scale": scale, "order": order}
FULL = {"events": 1000, "rounds": 2, "backlog": 50_000, "b_events": 200, "fanout_events": 20_000}
FULL.update(keys=500, per_key=20)  # order's
QUICK = {"events": 20, "rounds": 1, "backlog": 300, "b_events": 10, "fanout_events": 200}
QUICK.update(keys=20, per_key=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario",
        default="noisy,fairness,scale",
        help="comma-separated: noisy, fairness, scale, order (default: all but order)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the script runs")
    parser.add_argument("--events", type=int, help="noisy: events fanned out to every endpoint")
    parser.add_argument("--rounds", type=int, help="noisy: rounds of both configurations")
    parser.add_argument("--backlog", type=int, help="fairness: endpoint A's backlog")
    parser.add_argument("--fanout-events", type=int, help="scale: events, 2 endpoints each")
    parser.add_argument("--keys", type=int, help="order: keys")
    parser.add_argument("--per-key", type=int, help="order: events of each key")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    parser.add_argument("--dir", default=".", help="where the SQLite files go (a temp dir in it)")
    parser.add_argument("--receivers", help=argparse.SUPPRESS)  # (receivers_apart's child)
    args = parser.parse_args()
    if args.receivers is not None:
        asyncio.run(serve_apart(**json.loads(args.receivers)))
        return
    names = [n.strip() for n in args.scenario.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        parser.exit(2, f"endpoints.py: unknown scenario {unknown or args.scenario!r}\n")
    size = dict(QUICK if args.quick else FULL)
    for key in ("events", "rounds", "backlog", "fanout_events", "keys", "per_key"):
        if getattr(args, key) is not None:
            if getattr(args, key) < 1:
                parser.exit(2, f"endpoints.py: --{key.replace('_', '-')} must be >= 1\n")
            size[key] = getattr(args, key)
    results: list[dict[str, Any]] = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=args.dir) as tmp:
        for name in names:
            root = Path(tmp) / name
            root.mkdir()
            results += asyncio.run(SCENARIOS[name](root, size))
    print(
        f"load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
        f"({os.cpu_count()} cores); sizes {size}"
    )
    for r in results:
        verdict = "PASS" if r["pass"] else "FAIL"
        print(
            f"{r['target']:<36} {r['ratio']:>8.3f} {r['sense']} {r['bound']:<4} {verdict}"
            f"  ({r['detail']})"
        )
    if args.json:
        print(
            json.dumps({"sizes": size, "load": [load[0], os.getloadavg()[0]], "results": results})
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
