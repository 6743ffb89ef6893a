"""A shared send rate (``core.rate``): the rule, its plan on both drivers, its table."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import random
import re
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from aiohttp import web

from asnackq import cli
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import rate as r
from asnackq.core import worker as w
from asnackq.dispatch import BreakerPolicy
from asnackq.dispatch.slots import SAMPLES, Slots
from asnackq.lab import procs
from asnackq.lab.pace import fill as pace_fill
from asnackq.lab.pace import pace, recording_sink, watch_stalls
from asnackq.store import opening, pg_session
from asnackq.store.sqlite_aio import HOPS
from asnackq.wire.send import AsyncHttpSender

from .conftest import T0, rows
from .pgdb import statements, tracing
from .sinks import peer, serving
from .test_aio_hops import awaits, counting_queue, results

EVERY_US = 5_000  # 200 a second


def take(row: list[int], now: int, wanted: int) -> list[int]:
    """Slots a claim of ``wanted`` takes at ``now`` on ``row`` (interval, burst, tat),
    all of them used: the row moves on."""
    got = r.grant((*row, now), wanted)
    slots = [got.start_us + i * got.interval_us for i in range(got.permits)]
    if slots:
        row[2] = slots[-1] + got.interval_us
    return slots


@pytest.mark.parametrize("burst", [1, 5, 20])
def test_workers_claiming_at_random_never_beat_the_rate_nor_a_burst(burst):
    rng = random.Random(burst)
    row, now, slots, sends = [EVERY_US, burst, 0], 10**12, [], []
    for _ in range(4_000):
        now += rng.choice([0, 100, 2_000, 30_000, 400_000])  # idle spells too
        taken = take(row, now, rng.randint(0, 40))
        slots += taken
        sends += [max(slot, now) for slot in taken]  # each sent at its slot, never before
    assert slots == sorted(set(slots))  # one send a slot, every slot once
    for i, at in enumerate(sends):  # at most B at once, at most R a second after that
        assert bisect.bisect_left(sends, at + 1_000_000) - i <= 200 + burst
        assert bisect.bisect_right(sends, at) - i <= burst


def test_a_busy_limiter_grants_the_rate_and_slots_ahead_only_to_its_horizon():
    row, now, sends = [EVERY_US, 1, 0], 10**12, []
    for step in range(1_000):  # a claim every 10 ms, always wanting more
        slots = take(row, now + step * 10_000, 1_000)
        assert all(slot <= now + step * 10_000 + r.HORIZON_US for slot in slots)
        sends += slots
    judged = pace([t / 1e6 for t in sends], 200.0)
    assert judged.capped and judged.kept and judged.max_window == 200


def test_a_bunch_the_recorder_noted_late_is_left_unjudged_and_any_other_is_caught():
    steady = [i / 100 for i in range(600)]  # 100 a second for 6 s
    bunched = sorted([*steady, *[3.0] * 40])  # 40 noted at once when the recorder woke up
    assert not pace(bunched, 100.0).capped
    judged = pace(bunched, 100.0, stalls=[(2.6, 3.0)])
    assert judged.capped and judged.max_window <= 101 and 0 < judged.unjudged < 200, judged
    assert judged.mean > pace(steady, 100.0).mean  # every arrival still counts for the mean
    elsewhere = pace(sorted([*steady, *[4.5] * 40]), 100.0, stalls=[(2.6, 3.0)])
    assert not elsewhere.capped and elsewhere.max_window >= 140, elsewhere


async def test_the_recorder_notes_a_stall_of_its_own_loop():
    stalls: list[tuple[float, float]] = []
    watchdog = asyncio.ensure_future(watch_stalls(stalls))
    await asyncio.sleep(0.05)
    held = asyncio.get_running_loop().time()
    time.sleep(0.3)  # noqa: ASYNC251  # (the stall is the point)
    await asyncio.sleep(0.05)
    watchdog.cancel()
    await asyncio.gather(watchdog, return_exceptions=True)
    assert any(start <= held + 0.01 and end >= held + 0.3 for start, end in stalls), stalls


def test_a_clock_stepped_back_neither_stops_the_limiter_nor_grants_a_burst():
    row, now = [EVERY_US, 10, 0], 10**12
    assert len(take(row, now, 1_000)) == 10 + r.HORIZON_US // EVERY_US  # burst + horizon
    stepped = now - 3_600_000_000  # an hour back: one slot, a horizon ahead, no burst
    assert take(row, stepped, 1_000) == [stepped + r.HORIZON_US]
    later = stepped + 50_000
    slots = take(row, later, 1_000)  # the limiter goes on at its rate, from its clock
    assert slots == [stepped + r.HORIZON_US + EVERY_US * i for i in range(1, 11)]
    forward = later + 3_600_000_000  # a step forward: a burst of B, no more
    assert sum(1 for slot in take(row, forward, 1_000) if slot <= forward) == 10


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), float("inf"), 1e9, "5", None, True])
def test_a_rate_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="rate must be"):
        r.check_rate(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, 10**9, "2"])
def test_a_burst_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="burst"):
        r.check_rate(10, bad)


def fill(con: sqlite3.Connection, n: int, now: int = T0) -> None:
    w.enqueue_many(con, [({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(n)], now)


def test_open_queue_makes_no_rate_table_and_the_setup_makes_one(con):
    tables = "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'asnackq_rate'"
    assert con.execute(tables).fetchall() == []
    w.drive(con, r.plan_rate_setup(r.check_rate(200.0, 3)))
    w.drive(con, r.plan_rate_setup(r.check_rate(50, 2)))  # a new rate replaces the old
    assert con.execute("SELECT key, interval_us, burst FROM asnackq_rate").fetchall() == [
        ("sends", 20_000, 2)
    ]


def test_a_paced_cycle_claims_only_its_permits_and_returns_the_unused(con):
    rate = r.check_rate(200.0)
    w.drive(con, r.plan_rate_setup(rate))
    allowed = r.HORIZON_US // EVERY_US + 1  # from now to the horizon, one slot each
    fill(con, allowed + 9)
    plan = r.plan_paced_cycle(rate, [], [], "w1", T0 + 1, 5_000, 8, 200, limits=w.CONTRACT)
    first = w.drive(con, plan)
    assert len(first.cycle[2]) == len(first.waits_us) == allowed and first.short
    assert first.waits_us == sorted(first.waits_us) and first.waits_us[0] == 0
    assert all(b - a == EVERY_US for a, b in itertools.pairwise(first.waits_us))
    # 9 jobs left, time enough for more slots (the row idle since): 9 taken, the rest go back
    con.execute("UPDATE asnackq_rate SET tat_us = 0")
    plan = r.plan_paced_cycle(rate, [], [], "w1", T0 + 1, 5_000, 50, 0, limits=w.CONTRACT)
    before = time.time_ns() // 1000
    rest = w.drive(con, plan)
    after = time.time_ns() // 1000
    assert len(rest.cycle[2]) == 9 and not rest.short
    (tat,) = con.execute("SELECT tat_us FROM asnackq_rate").fetchone()
    assert before - 2_000 <= tat - 9 * EVERY_US <= after + 2_000  # the database's clock


def test_a_cycle_without_claims_reads_no_permit(con, statements):
    rate = r.check_rate(10.0)
    w.drive(con, r.plan_rate_setup(rate))
    statements.clear()
    w.drive(con, r.plan_paced_cycle(rate, [], [], "w1", T0, 5_000, 0, 0, limits=w.CONTRACT))
    assert statements == ["BEGIN IMMEDIATE", "COMMIT"]


async def test_permits_ride_in_the_claims_transaction_two_hops_more_whatever_the_batch(db):
    queue, counting = await counting_queue(db)
    rate = r.check_rate(100_000.0, 10_000)
    try:
        await queue.limit_rate(rate)
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(600)], T0)
        held = await queue.claim_many("w1", T0 + 1, 5_000, 6)
        one, hops_one = await awaits(
            counting,
            queue.paced_cycle(rate, results(held[:1], T0 + 2), held[1:2], "w1", T0 + 2, 5_000, 1),
        )
        many, hops_many = await awaits(
            counting,
            queue.paced_cycle(rate, results(held[2:4], T0 + 3), held[4:], "w1", T0 + 3, 5_000, 500),
        )
    finally:
        await queue.close()
    assert len(one.cycle[2]) == 1 and len(many.cycle[2]) == 500
    assert hops_one == hops_many == HOPS["paced cycle"] == HOPS["cycle"] + 2


async def test_a_paced_cycle_runs_the_same_on_postgresql(pg_db):
    url = pg_db()
    rate = r.check_rate(200.0)
    async with AsyncQueue.open(url, limits=w.CONTRACT) as queue:
        await queue.limit_rate(rate)
        await queue.limit_rate(rate)  # again: the table is there, the row replaced
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(90)], T0)
        first = await queue.paced_cycle(rate, [], [], "w1", T0 + 1, 5_000, 8, 100)
        second = await queue.paced_cycle(rate, [], [], "w1", T0 + 1, 5_000, 8, 100)
    allowed = r.HORIZON_US // EVERY_US + 1
    assert len(first.cycle[2]) == allowed and first.short
    # the second claim finds the slots to the horizon taken: few or none, never early
    assert len(second.cycle[2]) < allowed
    assert all(wait >= 0 for wait in second.waits_us)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--rate", "0"),
        ("--rate", "-5"),
        ("--rate", "nan"),
        ("--rate", "inf"),
        ("--rate", "1e9"),
        ("--rate", "fast"),
        ("--burst", "0"),
        ("--burst", "2.5"),
    ],
)
def test_work_refuses_a_rate_or_burst_out_of_range_in_one_line_changing_nothing(
    tmp_path, capsys, option, value
):
    queue = tmp_path / "queue.db"
    argv = ["work", str(queue), "--sink", "http://127.0.0.1:9/events", option, value]
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, *(["--rate", "10"] if option == "--burst" else [])])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and "Traceback" not in err
    assert not queue.exists()


def test_work_refuses_a_burst_without_a_rate(tmp_path, capsys):
    queue = tmp_path / "queue.db"
    w.open_queue(queue).close()
    before = queue.read_bytes()
    argv = ["work", str(queue), "--sink", "http://127.0.0.1:9/events", "--burst", "5"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == "asnackq work: --burst goes with --rate R"
    assert queue.read_bytes() == before


def test_slots_are_placed_with_the_smallest_delay_seen_never_early():
    slots, offset = Slots(), 100.0  # the event loop's clock reads the database's + 100 s

    def paced(now_s: float, *waits_us: int) -> r.Paced:
        return r.Paced(([], [], [], {}), list(waits_us), round(now_s * 1e6), False)

    assert slots.lead_us() == r.MAX_LEAD_US  # no cycle seen yet: the longest
    at = 1000.0 + offset + 0.005
    assert slots.place(paced(1000.0, 0, 5_000), at - 0.01, at) == pytest.approx(
        [1100.005, 1100.010]
    )
    # a slow commit (80 ms): its slots are not pushed 80 ms late onto the next cycle's,
    at = 1000.1 + offset + 0.080
    assert slots.place(paced(1000.1, 0), at - 0.09, at) == pytest.approx([1100.105])
    assert slots.lead_us() == 50_000  # the next claims' slots: the median cycle's time later
    # a database clock stepped back an hour: the old offset leaves with the window
    for i in range(SAMPLES):
        at = i + offset + 0.001
        placed = slots.place(paced(i - 3600.0, 0), at - 0.002, at)
    assert placed == pytest.approx([SAMPLES - 1 + offset + 0.001])
    assert slots.lead_us() == 2_000  # the slow commit left the window too


def test_a_claims_lead_moves_its_slots_later_and_never_reads_as_a_clock_step():
    row, now = [EVERY_US, 1, 0], 10**12
    got = r.grant((*row, now), 1_000, r.MAX_LEAD_US)
    assert got.start_us == now + r.MAX_LEAD_US and got.now_us == now
    assert got.permits == r.HORIZON_US // EVERY_US + 1
    row[2] = got.start_us + got.permits * EVERY_US
    # a claimer without a lead, right after: nothing yet, and no step back read into it
    assert r.grant((*row, now), 1_000).permits == 0
    later = r.grant((*row, now + r.MAX_LEAD_US + EVERY_US), 1_000)
    assert later.start_us == row[2] and later.permits == 1


def shape(statement: str) -> str:
    """A statement with its values, bound or to be bound, as ``?``."""
    return re.sub(r"'[^']*'|\b\d+\b|%s", "?", statement)


async def test_on_postgresql_permits_ride_in_the_claims_transaction_two_round_trips_more(pg_db):
    url = pg_db()
    store = await opening.open_store(url, w.SCHEMA)
    seen: list[str] = []
    queue = AsyncQueue(store, limits=w.CONTRACT)
    rate = r.check_rate(100_000.0, 10_000)
    try:
        await queue.limit_rate(rate)
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(40)], T0)
        held = await queue.claim_many("w1", T0 + 1, 5_000, 4)
        assert isinstance(store, pg_session.AsyncStore) and store.con is not None
        store.con.cursor_factory = tracing(
            lambda sql: seen.extend(" ".join(one.split()) for one in statements(sql))
        )[1]
        await queue.cycle(results(held[:1], T0 + 2), held[1:2], "w1", T0 + 2, 5_000, 8)
        plain, seen[:] = list(seen), []
        paced = await queue.paced_cycle(
            rate, results(held[2:3], T0 + 3), held[3:], "w1", T0 + 3, 5_000, 8
        )
    finally:
        await queue.close()
    assert len(paced.cycle[2]) == 8
    assert plain[0] == seen[0] == "BEGIN" and plain[-1] == seen[-1] == "COMMIT"
    # the same cycle (a transaction's first statement is bound client-side: its values
    # written in, where the others have placeholders), and
    assert [shape(s) for s in seen if "asnackq_rate" not in s] == [shape(s) for s in plain]
    rate_steps = [i for i, s in enumerate(seen) if "asnackq_rate" in s]
    # read, spend (the last statement before COMMIT: the transaction's id came with the
    # cycle's settle)
    assert len(seen) == len(plain) + 2 and rate_steps == [1, len(seen) - 2]


async def test_a_stalled_worker_takes_new_slots_instead_of_sending_late_in_a_bunch(db, tmp_path):
    await pace_fill(db, 300)
    async with (
        recording_sink(tmp_path / "sink.db") as (url, arrivals),
        AsyncQueue.open(db) as queue,
        AsyncHttpSender(url, timeout_s=1.0) as http,
    ):
        sent = 0

        async def send(event: dict[str, object], token: int | None) -> object:
            nonlocal sent
            sent += 1
            if sent == 100:  # the whole process stalls: every waiting slot passes
                time.sleep(0.5)  # noqa: ASYNC251  # (a stall is the point)
            return await http(event, token)

        dispatcher = Dispatcher(queue, send, owner="w1", lease_ms=5000, rate=100.0)
        summary = await dispatcher.run(until_empty=True)
    assert summary.done == 300
    times = sorted(arrivals)
    most = max(bisect.bisect_left(times, t + 0.1) - i for i, t in enumerate(times))
    # A tenth of a second's slots, the late ones, and the jitter of a loaded machine (the
    # sink records arrivals on the same event loop); sent late together they are 30 and more.
    assert most <= 10 + 2 + 8
    assert pace(times, 100.0).capped


async def test_a_new_rate_between_runs_replaces_the_old_for_the_queue(db):
    async def send(event: dict[str, object], token: int | None) -> bool:
        return True

    rows = "SELECT key, interval_us, burst FROM asnackq_rate"
    async with AsyncQueue.open(db) as queue:
        for per_s, burst, jobs in ((50.0, 1, 5), (400.0, 3, 40)):
            await queue.enqueue_many([{"id": f"r{burst}-{i}", "qty": 1} for i in range(jobs)])
            dispatcher = Dispatcher(queue, send, owner="w1", rate=per_s, burst=burst)
            began = time.monotonic()
            assert (await dispatcher.run(until_empty=True)).done == jobs
            assert time.monotonic() - began >= (jobs - burst) / per_s  # paced by it
            assert await queue.read(rows) == [("sends", round(1e6 / per_s), burst)]


async def test_every_re_send_under_the_same_lease_takes_a_slot_of_its_own(db):
    """A peer answers each job 503 twice (the sink away), then 429 with ``Retry-After: 0``,
    then ACKs: four sends a job, the re-sends due after a millisecond or two.  At 50 a
    second none of the one-second windows at the peer holds more than the rate and the
    burst: re-sends wait for slots of their own."""
    answers: dict[str, int] = {}
    arrivals: list[float] = []

    async def handler(request: web.Request) -> web.Response:
        arrivals.append(asyncio.get_running_loop().time())
        event = await request.json()
        seen = answers[event["id"]] = answers.get(event["id"], 0) + 1
        if seen <= 2:
            return web.json_response({"status": "unavailable"}, status=503)
        if seen == 3:
            return web.json_response({"status": "busy"}, status=429, headers={"Retry-After": "0"})
        return web.json_response({"id": event["id"], "status": "applied"})

    await pace_fill(db, 30)
    async with (
        serving(peer(handler)) as running,
        AsyncQueue.open(db) as queue,
        AsyncHttpSender(running.url, timeout_s=1.0) as send,
    ):
        dispatcher = Dispatcher(
            queue,
            send,
            owner="w1",
            concurrency=8,
            lease_ms=5000,
            rate=50.0,
            retry=w.Retry(1, 2),
            breaker=BreakerPolicy(after=10_000),
        )
        summary = await asyncio.wait_for(dispatcher.run(until_empty=True), 60)
    assert (summary.done, summary.requests, summary.retried) == (30, 120, 0)
    judged = pace(arrivals, 50.0, skip_s=0.0)  # (without slots: 120 sends in 0.6 s)
    assert judged.seconds > 2.0 and judged.mean <= 50 * 1.05, judged
    assert judged.max_window <= 50 + 1 + 2, judged  # (two for a loaded machine's jitter)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_the_queue_s_rate_is_read_and_removed_the_same_on_both_drivers(db, pg_db, backend):
    target = db if backend == "sqlite" else pg_db()
    async with AsyncQueue.open(target) as queue:
        assert await queue.shared_rate() is None  # no table yet
        assert await queue.clear_rate() is False
        await queue.limit_rate(r.check_rate(40.0, 3))
        assert await queue.shared_rate() == r.Rate(40.0, 3)
        assert await queue.clear_rate() is True
        assert await queue.shared_rate() is None
        assert await queue.clear_rate() is False


async def test_a_run_given_no_rate_takes_the_queue_s(db, tmp_path):
    """The queue's rate is 40 a second: a Dispatcher given none sends at that pace."""
    await pace_fill(db, 90)
    async with (
        recording_sink(tmp_path / "sink.db") as (url, arrivals),
        AsyncQueue.open(db) as queue,
        AsyncHttpSender(url, timeout_s=1.0) as http,
    ):
        await queue.limit_rate(r.check_rate(40.0))
        dispatcher = Dispatcher(queue, http, owner="w1", lease_ms=5000)
        summary = await asyncio.wait_for(dispatcher.run(until_empty=True), 60)
    assert summary.done == 90 and dispatcher.settings.rate == r.Rate(40.0)
    judged = pace(arrivals, 40.0)
    assert judged.capped and judged.mean <= 40 * 1.05, judged


async def test_a_rate_removed_mid_run_lets_the_paced_run_go_on_unpaced(db, tmp_path):
    """At 20 a second 200 jobs take 10 s; the rate is removed (from another connection)
    after 20 sends: the run goes on, unpaced, and ends well within that."""
    await pace_fill(db, 200)
    removed = asyncio.Event()
    async with (
        recording_sink(tmp_path / "sink.db") as (url, arrivals),
        AsyncQueue.open(db) as queue,
        AsyncQueue.open(db) as operator,
        AsyncHttpSender(url, timeout_s=1.0) as http,
    ):

        async def send(event: dict[str, object], token: int | None) -> object:
            if len(arrivals) == 20:
                removed.set()
            return await http(event, token)

        dispatcher = Dispatcher(queue, send, owner="w1", lease_ms=5000, rate=20.0)
        run = asyncio.ensure_future(dispatcher.run(until_empty=True))
        await asyncio.wait_for(removed.wait(), 10)
        assert await operator.clear_rate() is True
        began = time.monotonic()
        summary = await asyncio.wait_for(run, 30)
    assert summary.done == 200 and summary.dead == 0
    assert time.monotonic() - began < 5  # (180 more at 20 a second: 9 s)


def test_work_rate_off_removes_the_queue_s_rate_and_a_worker_given_none_shows_the_queue_s(
    tmp_path, capsys
):
    queue = tmp_path / "queue.db"
    w.open_queue(queue).close()
    con = sqlite3.connect(queue)
    w.drive(con, r.plan_rate_setup(r.check_rate(25.0, 2)))
    con.close()
    base = ["work", str(queue), "--sink", "http://127.0.0.1:9/events", "--until-empty"]
    assert cli.main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rate"] == {"per_s": 25.0, "burst": 2}
    assert cli.main([*base, "--rate", "off", "--burst", "2"]) == 2
    assert capsys.readouterr().err.strip() == "asnackq work: --burst goes with --rate R"
    assert cli.main([*base, "--rate", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rate"] is None
    con = sqlite3.connect(queue)
    assert con.execute("SELECT count(*) FROM asnackq_rate").fetchone() == (0,)
    con.close()


def queue_with_rate_row(path: Path, interval_us: int, burst: int) -> Path:
    """A queue whose rate row was written by hand (or by another version)."""
    w.open_queue(path).close()
    con = sqlite3.connect(path)
    w.drive(con, r.plan_rate_setup(r.check_rate(25.0, 2)))
    with con:
        con.execute("UPDATE asnackq_rate SET interval_us = ?, burst = ?", (interval_us, burst))
    con.close()
    return path


@pytest.mark.process
@pytest.mark.parametrize(
    ("interval_us", "burst"),
    [(0, 1), (-40_000, 1), (40_000, 0), (1, 1), (2**62, 1), (2**63 - 1, 1), (2.5, 1)],
)
def test_work_on_a_queue_whose_rate_row_is_out_of_range_says_so_in_one_line(
    tmp_path, interval_us, burst
):
    """A rate row with interval 0, a negative interval, a burst of 0, a rate above
    MAX_SEND_RATE or below MIN_SEND_RATE, or an interval that is no int (written by hand): a
    worker given no rate says so in one line and exits 1, never a traceback or a run at a
    bogus rate."""
    queue = queue_with_rate_row(tmp_path / "queue.db", interval_us, burst)
    done = subprocess.run(
        [*procs.command("work", queue, "--sink", "http://127.0.0.1:9/events", "--until-empty")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(("interval_us", "burst"), [(0, 1), (-40_000, 1), (40_000, 0)])
def test_shared_rate_never_returns_a_rate_check_rate_refuses(tmp_path, interval_us, burst):
    queue = queue_with_rate_row(tmp_path / "queue.db", interval_us, burst)
    con = sqlite3.connect(queue)
    try:
        rate = w.drive(con, r.plan_shared_rate())
    except ValueError:
        return  # refused with a clear error: fine
    finally:
        con.close()
    assert rate is None or rate == r.check_rate(*rate), rate


def test_shared_rate_never_returns_a_rate_above_max_rate(tmp_path):
    """An interval of 1 us would be 1e6 sends a second, ten times MAX_SEND_RATE: refused."""
    queue = queue_with_rate_row(tmp_path / "queue.db", 1, 1)
    con = sqlite3.connect(queue)
    try:
        with pytest.raises(ValueError, match="out of range"):
            w.drive(con, r.plan_shared_rate())
    finally:
        con.close()


@pytest.mark.process
@pytest.mark.parametrize(
    "typed",
    [" 9", "9 ", "+9", "9_0", "\u0669", "1e-30", "0.0005", "1e400", "100001", "nan", "0x10"],
)
def test_a_rate_not_plainly_written_or_out_of_range_is_a_usage_error(tmp_path, typed):
    """``--rate`` takes a number written plainly in ASCII in MIN_SEND_RATE..MAX_SEND_RATE
    (whose interval fits the queue's rate row): anything else is exit 2 and one line naming
    the range, with the queue untouched."""
    queue = tmp_path / "queue.db"
    w.open_queue(queue).close()
    before = queue.read_bytes()
    argv = ["work", queue, "--sink", "http://127.0.0.1:9/e", "--until-empty", "--rate", typed]
    done = subprocess.run(procs.command(*argv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{r.MIN_SEND_RATE:g}..{r.MAX_SEND_RATE:g}" in done.stderr.splitlines()[-1]
    assert queue.read_bytes() == before


@pytest.mark.parametrize("per_s", [r.MIN_SEND_RATE, r.MAX_SEND_RATE])
def test_the_rates_at_the_ends_of_the_range_round_trip_through_the_row(tmp_path, per_s):
    """The slowest and the fastest rate are stored as an interval a row holds and read back
    as the same rate."""
    rate = r.check_rate(per_s)
    assert r.rate_of((round(1_000_000 / rate.per_s), 1), "default").per_s == pytest.approx(per_s)
    with pytest.raises(ValueError, match=re.escape("0.001..100000")):
        r.check_rate(per_s * (0.5 if per_s == r.MIN_SEND_RATE else 2))


@pytest.mark.process
@pytest.mark.parametrize("typed", ["OFF", "Off", " off"])
def test_rate_off_typed_otherwise_is_named_in_the_usage_line(tmp_path, typed):
    """``--rate OFF`` is refused in a line that names 'off' (the one word accepted) and no
    range that would take 0."""
    queue = tmp_path / "queue.db"
    w.open_queue(queue).close()
    argv = ["work", queue, "--sink", "http://127.0.0.1:9/e", "--until-empty", "--rate", typed]
    done = subprocess.run(procs.command(*argv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "'off'" in done.stderr and "0.." not in done.stderr, done.stderr


async def test_a_worker_started_before_any_rate_keeps_to_the_rate_set_later(db, tmp_path):
    """A worker that started while the queue had no rate keeps to the one another worker
    sets later (it looks for it every RATE_CHECK_S), also with the tickets it claimed
    before: 60 jobs at 20 a second take about 3 s, not the 0.3 s they take unpaced."""
    await pace_fill(db, 60)
    first, rated = asyncio.Event(), asyncio.Event()
    async with (
        recording_sink(tmp_path / "sink.db") as (url, arrivals),
        AsyncQueue.open(db) as queue,
        AsyncQueue.open(db) as other,
        AsyncHttpSender(url, timeout_s=1.0) as http,
    ):

        async def send(event: dict[str, object], token: int | None) -> object:
            first.set()
            await rated.wait()
            return await http(event, token)

        dispatcher = Dispatcher(queue, send, owner="w1", concurrency=4, lease_ms=5000)
        run = asyncio.ensure_future(dispatcher.run(until_empty=True))
        await asyncio.wait_for(first.wait(), 10)
        await other.limit_rate(r.check_rate(20.0))  # another worker: work --rate 20
        for _ in range(200):  # (looked for every RATE_CHECK_S: within a second)
            if dispatcher.settings.rate is not None:
                break
            await asyncio.sleep(0.02)
        assert dispatcher.settings.rate == r.Rate(20.0)
        began = time.monotonic()
        rated.set()
        summary = await asyncio.wait_for(run, 30)
    assert summary.done == 60
    judged = pace(arrivals, 20.0, skip_s=0.0)
    assert time.monotonic() - began > 2.0 and judged.max_window <= 20 + 4 + 2, judged


@pytest.mark.parametrize("per_s", [1.0, 0.05])
async def test_a_slow_rate_with_the_receiver_away_waits_for_its_permits_and_stops_when_asked(
    db, per_s
):
    """Under a shared rate of 1/s (or 0.05/s) a receiver that is away makes every held ticket
    ask for a new slot, which the rate grants seconds later: the committer asks again when a
    permit can be granted, not in a loop (a few transactions a second, not thousands), and a
    cancelled run stops within its grace, its waiting tickets left leased."""
    port = socket_port()
    async with (
        AsyncQueue.open(db) as queue,
        AsyncHttpSender(f"http://127.0.0.1:{port}/events", timeout_s=1) as send,
    ):
        for i in range(10):
            await queue.enqueue({"id": f"j{i}", "qty": 1})
        dispatcher = Dispatcher(
            queue, send, owner="w", concurrency=4, rate=per_s, grace_s=1.0, lease_ms=5000
        )
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(dispatcher.run(follow=True))
        await asyncio.sleep(3)
        began = loop.time()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 30)
        stopped_s = loop.time() - began
    summary = dispatcher.summary
    assert summary.done == 0 and summary.requests >= 1
    assert summary.commits < 200, summary.commits  # (a loop made thousands in 3 s)
    assert stopped_s < 20  # the grace, and the last commit
    assert {r[3] for r in rows(db) if len(r) > 3} <= {"pending", "leased"}


def socket_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
