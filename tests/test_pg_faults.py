"""Database faults during a real run: ``asnackq work`` and ``asnackq sink`` on PostgreSQL
while the server restarts, their sessions are killed, or the server is away for seconds.

Each fault is its own test on a server of this module's own (the tests restart it).  After
each one: the worker exited 0 with its summary, every job is done, every effect was applied
once, no stale finish was accepted (``evidence.verify``), and the outage was counted.
"""

from __future__ import annotations

import asyncio
import json
import select
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from asnackq.aio import Dispatcher
from asnackq.core import worker as w
from asnackq.dispatch.committer import CLOSE_WAIT_S
from asnackq.dispatch.traces import read_traces
from asnackq.lab import evidence
from asnackq.lab.pg_server import DURABLE, LocalServer, free_port
from asnackq.lab.procs import PIPE, command, kill, reap, sink_process, sink_stats, started, worker
from asnackq.store import sessions
from asnackq.store.outage import CommitUnknown

from . import pgdb
from .conftest import T0
from .pgdb import query
from .slow_commit import in_commit, job_row, slow_queue
from .test_dashboard import dashboard, state, until

JOBS = 800
# Commits are synchronous (an immediate shutdown keeps what it acknowledged); fsync is off
# (a crash of the server is not one of the machine), for speed.
SETTINGS = {**DURABLE, "fsync": "off", "full_page_writes": "off"}
Fault = Callable[[LocalServer, str], None]  # (the server, the sink's URL)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    """A server for this module alone: its tests restart and stop it."""
    for pool in pgdb.start_server(SETTINGS):
        yield pool.server


@pytest.fixture
def url(server: LocalServer) -> Iterator[str]:
    """A fresh database on the module's server (dropped after the test)."""
    name = f"faults_{time.monotonic_ns()}"
    with psycopg.connect(server.url(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    yield server.url(name)
    with psycopg.connect(server.url(), autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def done(url: str) -> int:
    """Jobs done so far, or -1 while the server does not answer."""
    try:
        return int(pgdb.query(url, "SELECT count(*) FROM jobs WHERE status = 'done'")[0][0])
    except psycopg.OperationalError:
        return -1


def terminate(server: LocalServer, app: str) -> int:
    """``pg_terminate_backend`` every session whose application_name is ``app``."""
    rows = pgdb.query(
        server.url(),
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        (app,),
    )
    return len(rows)


def fill(url: str) -> dict[str, int]:
    """A new queue at ``url`` with ``JOBS`` jobs: their ids and qtys."""
    qty = {f"j{i}": i % 7 + 1 for i in range(JOBS)}
    sessions.init(url)
    with sessions.open_session(url) as queue:
        items = [({"id": i, "qty": q}, 600_000, 3) for i, q in qty.items()]
        queue.run(lambda: w.plan_enqueue_many(items, w.epoch_ms(), limits=w.PRODUCT))
    return qty


def under_way(url: str) -> None:
    """Return once a tenth of the jobs is done, and not all of them (bounded)."""
    deadline = time.monotonic() + 60
    while done(url) < JOBS // 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert done(url) < JOBS, "the run ended before the fault"


def run_through(
    fault: Fault,
    server: LocalServer,
    url: str,
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    lease_ms: int = 4000,
) -> tuple[dict[str, int], dict[str, int]]:
    """A worker and a sink deliver ``JOBS`` jobs; ``fault`` strikes once a tenth is done.

    Returns the worker's summary and the sink's counters, read after the run.
    """
    qty = fill(url)
    monkeypatch.setenv("PGAPPNAME", "fault-sink")  # (libpq names the session after it)
    with sink_process(url, "--delay-ms", "2") as sink:
        monkeypatch.setenv("PGAPPNAME", "fault-worker")
        options = ("--until-empty", "--json", "--concurrency", "16", "--lease-ms", str(lease_ms))
        work = worker(url, sink, *options, "--trace", tmp / "w.trace", stdout=PIPE, stderr=PIPE)
        try:
            under_way(url)
            fault(server, sink)
            out, err = work.communicate(timeout=50)
        finally:
            kill(work)
        stats = sink_stats(sink)  # the sink answers again
    assert work.returncode == 0, err
    summary: dict[str, int] = json.loads(out)
    result = evidence.verify(url, url, qty, read_traces(tmp), stats)
    assert result.violations == []
    assert result.statuses == {"done": JOBS}
    assert result.inbox_rows == JOBS and result.stock == sum(qty.values())
    return summary, stats


def line_within(stream: object, timeout_s: float) -> str:
    """The next line of a child's pipe, or an AssertionError after ``timeout_s``."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, f"no line within {timeout_s} s"
    return str(stream.readline())  # type: ignore[attr-defined]


@pytest.mark.process
def test_work_and_a_sink_started_while_the_server_is_down_wait_for_it(server, url, tmp_path):
    qty = fill(url)
    port = free_port()  # (the worker names the sink before the sink can listen)
    server.halt("fast")
    down = True
    try:
        sink_argv = command("sink", "--db", url, "--port", port, "--delay-ms", "2")
        with started(sink_argv, stdout=PIPE, stderr=PIPE) as sink:
            sink_url = f"http://127.0.0.1:{port}/events"
            options = ("--until-empty", "--json", "--trace", tmp_path / "w.trace")
            work = worker(url, sink_url, *options, stdout=PIPE, stderr=PIPE)
            try:
                for proc, name in ((sink, "sink"), (work, "work")):
                    waiting = line_within(proc.stderr, 20)
                    assert waiting.startswith(f"asnackq {name}: waiting for the database at ")
                    assert "(up to 300 s)" in waiting and proc.poll() is None
                server.resume()
                down = False
                assert line_within(sink.stdout, 20).startswith("asnackq sink listening on ")
                out, err = work.communicate(timeout=60)
            finally:
                kill(work)
            assert work.returncode == 0, err
            assert err.count("waiting for the database") == 0  # (its one line was read)
            stats = sink_stats(sink_url)
    finally:
        if down:
            server.resume()
    assert json.loads(out)["done"] == JOBS
    result = evidence.verify(url, url, qty, read_traces(tmp_path), stats)
    assert result.violations == [] and result.statuses == {"done": JOBS}


@pytest.mark.process
def test_a_server_down_past_db_wait_s_is_one_line_and_exit_1(server, url):
    server.halt("fast")
    try:
        argv = command("sink", "--db", url, "--db-wait-s", "0.5")
        with started(argv, stdout=PIPE, stderr=PIPE) as sink:
            out, err = sink.communicate(timeout=20)
    finally:
        server.resume()
    assert sink.returncode == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2, err  # it waits, then gives up
    assert lines[0].startswith("asnackq sink: waiting for the database at ")
    assert lines[1].startswith("asnackq sink: cannot connect to postgresql://")


@pytest.mark.process
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_work_and_sink_ride_out_a_server_restart(server, url, tmp_path, monkeypatch, mode):
    summary, stats = run_through(lambda s, _: s.restart(mode), server, url, tmp_path, monkeypatch)
    assert summary["db_outages"] >= 1 and summary["db_down_ms"] > 0
    assert stats["db_outages"] >= 1


@pytest.mark.process
def test_work_rides_out_its_session_killed(server, url, tmp_path, monkeypatch):
    summary, stats = run_through(
        lambda s, _: terminate(s, "fault-worker"), server, url, tmp_path, monkeypatch
    )
    assert summary["db_outages"] == 1
    assert stats["db_outages"] == 0


@pytest.mark.process
def test_the_sink_rides_out_its_session_killed(server, url, tmp_path, monkeypatch):
    summary, stats = run_through(
        lambda s, _: terminate(s, "fault-sink"), server, url, tmp_path, monkeypatch
    )
    assert summary["db_outages"] == 0
    assert stats["db_outages"] == 1


@pytest.mark.process
def test_work_and_sink_ride_out_a_server_away_for_seconds(server, url, tmp_path, monkeypatch):
    def away(s: LocalServer, sink: str) -> None:
        s.halt("fast")
        started = time.monotonic()
        base = sink.rsplit("/", 1)[0]
        for path in ("/stats", "/events/j1"):  # the reads answer 503, as JSON
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base + path, timeout=10)
            assert refused.value.code == 503
            assert json.load(refused.value)["status"] == "unavailable"
            refused.value.close()
        with urllib.request.urlopen(base + "/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert "asnackq_sink_db_up 0" in metrics and "asnackq_sink_stock" not in metrics
        time.sleep(max(0.0, 3 - (time.monotonic() - started)))  # the fault's length
        s.resume()

    # Each counts from when it found its session gone (its next use of it) to its return.
    # The sink's next use is the first request after the halt.  The worker's may wait
    # for its next lease extension (its sends meet a sink that answers 503, so no result
    # asks for a cycle): due once half a lease is left, so with a lease of 1 s it comes
    # within about 0.5 s of the halt, and each count is most of the 3 s.
    summary, stats = run_through(away, server, url, tmp_path, monkeypatch, lease_ms=1000)
    assert summary["db_outages"] >= 1 and summary["db_down_ms"] >= 1500
    assert stats["db_outages"] >= 1 and stats["db_down_ms"] >= 1500


@pytest.mark.process
def test_work_stopped_while_the_server_is_away_ends_in_time_with_its_summary(server, url, tmp_path):
    qty = fill(url)
    with sink_process(url, "--delay-ms", "2") as sink:
        options = ("--json", "--concurrency", "16", "--lease-ms", "4000", "--trace")
        work = worker(url, sink, *options, tmp_path / "w.trace", stdout=PIPE, stderr=PIPE)
        try:
            under_way(url)
            server.halt("fast")
            try:
                stopped = time.monotonic()
                work.send_signal(signal.SIGTERM)
                out, err = work.communicate(timeout=50)
                took = time.monotonic() - stopped
            finally:
                server.resume()
        finally:
            kill(work)
        assert work.returncode == 0, err
        summary = json.loads(out)
        assert summary["stopped_by_signal"] and summary["db_outages"] >= 1
        assert took < 5 + CLOSE_WAIT_S + 5  # grace, the closing wait, and a margin
        again = worker(url, sink, "--until-empty", "--json", "--trace", tmp_path / "w2.trace")
        assert reap(again, 50) == 0  # what it left leased is reclaimed and done
        stats = sink_stats(sink)
    result = evidence.verify(url, url, qty, read_traces(tmp_path), stats)
    assert result.violations == [] and result.statuses == {"done": JOBS}


@pytest.mark.process
async def test_a_commit_cut_by_a_crash_is_unconfirmed_and_the_store_goes_on(server, url):
    async with slow_queue(url) as (queue, store):
        claiming = asyncio.ensure_future(queue.claim("w1", T0 + 1, 5000))
        await in_commit(url, store.con.info.backend_pid)
        await asyncio.to_thread(server.restart, "immediate")
        with pytest.raises(CommitUnknown):  # the id may be another transaction's by now
            await claiming
        assert job_row(url) == ("pending", 0)  # (it had not committed: the sleep was cut)
        query(url, "DELETE FROM slow")
        ticket = await queue.claim("w1", T0 + 2, 5000)
        assert ticket is not None and ticket["token"] == 1
        counts = store.health.counts()
        assert (counts["db_outages"], counts["db_cut_commits"]) == (1, 1)


@pytest.mark.process
async def test_a_cycle_cut_by_a_crash_lets_its_ticket_go_and_the_job_ends_done(server, url):
    async with slow_queue(url, w.epoch_ms()) as (queue, store):
        sent = asyncio.Event()

        async def send(event: dict[str, object], token: int) -> bool:
            sent.set()
            return True

        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=1, lease_ms=4000)
        run = asyncio.ensure_future(dispatcher.run())
        await asyncio.wait_for(sent.wait(), 10)  # claimed (slowly) and sent
        await in_commit(url, store.con.info.backend_pid)  # the cycle that keeps or finishes it
        await asyncio.to_thread(server.restart, "immediate")
        query(url, "DELETE FROM slow")
        summary = await asyncio.wait_for(run, 30)  # reclaimed after its lease, and done
    assert (summary.unconfirmed, summary.claimed, summary.done, summary.stale) == (1, 2, 1, 0)
    assert summary.db_cut_commits == 1 and summary.db_outages == 1
    assert job_row(url) == ("done", 2)


@pytest.mark.process
async def test_a_run_stopped_while_its_cut_commit_is_unresolved_ends_in_its_closing_wait(
    server, url
):
    async with slow_queue(url, w.epoch_ms()) as (queue, store):
        sent = asyncio.Event()

        async def send(event: dict[str, object], token: int) -> bool:
            sent.set()
            return True

        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=1, lease_ms=4000, grace_s=1)
        run = asyncio.ensure_future(dispatcher.run(follow=True))
        await asyncio.wait_for(sent.wait(), 10)
        await in_commit(url, store.con.info.backend_pid)  # the cycle that finishes it
        await asyncio.to_thread(server.halt, "fast")  # its COMMIT cut; the server away
        try:
            stopped = time.monotonic()
            run.cancel()
            await asyncio.wait([run], timeout=1 + CLOSE_WAIT_S + 6)
            took = time.monotonic() - stopped
        finally:
            await asyncio.to_thread(server.resume)
        assert run.cancelled(), f"the run outlasted its closing wait ({took:.1f} s)"
        assert took < 1 + CLOSE_WAIT_S + 6
    summary = dispatcher.summary
    assert (summary.unconfirmed, summary.db_cut_commits, summary.done) == (1, 1, 0)
    assert job_row(url) == ("leased", 1)  # left to its lease, reclaimed later


@pytest.mark.process
def test_a_command_s_session_lost_between_its_transactions_is_opened_again(server, url):
    sessions.init(url)
    intake = [({"id": "a", "qty": 1}, 60_000, 3)]
    with sessions.open_session(url) as queue:
        assert queue.run(lambda: w.plan_enqueue_many(intake, w.epoch_ms())) == [True]
        server.restart("fast")  # its session is gone; the next plan runs on a new one
        assert queue.run(lambda: w.plan_enqueue_many(intake, w.epoch_ms())) == [False]
        terminate(server, "")  # (libpq's default application_name is empty)
        intake = [({"id": "b", "qty": 2}, 60_000, 3)]
        assert queue.run(lambda: w.plan_enqueue_many(intake, w.epoch_ms())) == [True]
    assert query(url, "SELECT id FROM jobs ORDER BY id") == [("a",), ("b",)]


SLOW_INSERT = (
    "CREATE TABLE slow (one INTEGER)",
    """CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$""",
    """CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON jobs DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION slow_commit()""",
)


@pytest.mark.process
def test_a_command_whose_commit_is_cut_says_so_in_one_line(server, url, monkeypatch):
    sessions.init(url)
    for sql in SLOW_INSERT:
        query(url, sql)
    monkeypatch.setenv("PGAPPNAME", "cut-me")
    argv = command("enqueue", url, "--id", "a", "--qty", "1")
    with started(argv, stdout=PIPE, stderr=PIPE) as enqueue:
        pid = committing(server, "cut-me")
        query(server.url(), "SELECT pg_terminate_backend(%s)", (pid,))
        out, err = enqueue.communicate(timeout=30)
    assert enqueue.returncode == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("asnackq enqueue: "), err
    assert "terminating connection" in err and "Traceback" not in err
    assert query(url, "SELECT count(*) FROM jobs") == [(0,)]  # (it was cut before it committed)


def committing(server: LocalServer, app: str) -> int:
    """The pid of session ``app`` once it is in its (slow) COMMIT (bounded)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rows = query(
            server.url(),
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND state = 'active'"
            " AND query = 'COMMIT' AND wait_event = 'PgSleep'",
            (app,),
        )
        if rows:
            return int(rows[0][0])
        time.sleep(0.02)
    raise AssertionError(f"no session {app} seen in its COMMIT")


@pytest.mark.process
@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_a_fleet_rides_out_a_server_restart(server, url, mode):
    """Two endpoints' deliveries through one fleet while ``pg_ctl restart`` runs under it:
    every delivery ends done, none dead, each event received by each endpoint."""
    from asnackq.aio import AsyncQueue, Fleet
    from asnackq.core.endpoints import Endpoint
    from asnackq.wire import webhooks as wh

    from .test_event_deliveries import hooks, statuses
    from .test_fleet import until

    secret = wh.new_secret()
    async with (
        hooks(secret) as (a, a_url),
        hooks(secret) as (b, b_url),
        AsyncQueue.open(url) as queue,
    ):
        for name, at in (("a", a_url), ("b", b_url)):
            await queue.add_endpoint(Endpoint(name, at, secrets=(secret,), concurrency=4))
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(200)])
        fleet = Fleet(queue, owner="fleet", retry=w.Retry(5, 20), lease_ms=3000)
        task = asyncio.ensure_future(fleet.run())
        try:
            await until(lambda: len(a.seen) + len(b.seen) >= 20, "deliveries under way")
            await asyncio.to_thread(server.restart, mode)
            await until(
                lambda: {s for s, _ in statuses(url).values()} == {"done"}, "every one done"
            )
        finally:
            task.cancel()
            await asyncio.wait([task])
    assert sorted(statuses(url).values()) == sorted([("done", "a")] * 200 + [("done", "b")] * 200)
    for seen in (a.seen, b.seen):
        assert {s.webhook_id for s in seen} == {f"e{i}" for i in range(200)}


@pytest.mark.process
def test_the_dashboard_says_the_server_is_away_and_shows_it_again_once_back(server, url):
    """A server away raised ``Unreachable`` (no ``ValueError``) in the dashboard's sampling
    task, which ended: its figures stayed frozen, ``error`` null, until it was restarted."""
    fill(url)
    with dashboard(url) as base:
        pending = {"pending": JOBS, "leased": 0, "done": 0, "dead": 0}
        until(lambda: (found := state(base))["error"] is None and found.get("stats"), 60)
        server.halt("fast")
        try:
            away = until(lambda: (found := state(base))["error"] and found, 60)
            assert "cannot read the queue" in away["error"]
            later = until(lambda: (found := state(base))["at_ms"] > away["at_ms"] and found, 60)
            assert later["error"]  # (still sampling, still saying why)
        finally:
            server.resume()
        back = until(lambda: (found := state(base))["error"] is None and found, 60)
        assert back["at_ms"] > later["at_ms"] and back["stats"]["by_status"] == pending
