"""The dashboard's job inspector (``/jobs/{id}``, ``/api/jobs/{id}``), leases by owner and done
per minute over the last hour: a real dashboard process over real queue files, a real sink's
inbox and a real PostgreSQL; hostile ids answered 400 or 404, never a 500, nothing written."""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from functools import partial

import psycopg
import pytest

from asnackq import ops
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.lab.procs import sink_process
from asnackq.ops import inspect
from asnackq.store import readers, reads, sessions
from asnackq.wire.send import HttpSender

from . import test_dashboard
from .page import Page
from .sinks import add_records
from .test_dashboard import request, state, until
from .test_dashboard_hostile import dashboard, get, locked, raw

dbs = test_dashboard.dbs  # a queue with a job in every state, and a sink DB
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACES = "CREATE TABLE asnackq_job_traces (job_id TEXT PRIMARY KEY, traceparent TEXT NOT NULL)"


def job(url, job_id):
    status, headers, body = request(url, f"/api/jobs/{job_id}")
    assert headers["Content-Type"].startswith("application/json")
    return status, json.loads(body)


def add_traces(queue, rows):
    con = sqlite3.connect(queue)
    with con:
        con.execute(TRACES)
        con.executemany("INSERT INTO asnackq_job_traces VALUES (?, ?)", rows)
    con.close()


@pytest.mark.process
def test_a_job_is_its_row_redrives_inbox_verdict_and_trace(dbs, tmp_path):
    queue, sink = dbs
    add_traces(queue, [("d", f"00-{TRACE_ID}-00f067aa0ba902b7-01"), ("b", "not-a-traceparent")])
    con = sqlite3.connect(sink)
    with con:  # o: applied by the sink, unknown to the queue
        add_records(con, [("o", 4, 2, 2, 1, 0, 0)])
    con.close()
    with dashboard(queue, "--sink-db", sink, log=tmp_path / "log") as url:
        stories = {name: job(url, name) for name in "abcdeo"}
        missing = job(url, "zz")
        page = request(url, "/jobs/d")
        missing_page = request(url, "/jobs/zz")
    assert all(status == 200 for status, _ in stories.values())
    d = stories["d"][1]
    assert d["job"]["status"] == "done" and d["job"]["token"] == 1 and d["job"]["attempts"] == 1
    assert d["inbox"]["first_token"] == d["inbox"]["last_token"] == 1
    assert d["inbox"]["deliveries"] == 2 and d["trace_id"] == TRACE_ID
    assert d["audit"] == {"stage": "done", "flags": []}
    b = stories["b"][1]  # dead (permanent), then redriven: pending, attempts renewed
    assert b["job"]["status"] == "pending" and b["job"]["attempts"] == 0
    assert [(r["token"], r["note"]) for r in b["redrives"]] == [(1, "fixed")]
    assert b["trace_id"] is None and b["inbox"] is None  # a malformed traceparent: none
    a = stories["a"][1]["job"]  # leased by old-worker, the lease expired
    assert a["owner"] == "old-worker" and a["token"] == 1 and a["lease_left_ms"] < 0
    assert 50_000 < a["deadline_left_ms"] <= 60_000
    c = stories["c"][1]["job"]
    assert c["status"] == "dead" and c["reason"] == "permanent" and c["lease_left_ms"] is None
    for name, (_, story) in stories.items():  # the audit's verdict on each, as audit says it
        audited = ops.audit(queue, sink, story["at_ms"], job_id=name).job
        assert audited is not None and story["audit"]["stage"] == audited["stage"]
        assert [f["flag"] for f in story["audit"]["flags"]] == audited["flags"]
    assert stories["e"][1]["audit"]["flags"] == [
        {"flag": "applied-not-done", "kind": "attention", "why": ops.ATTENTION["applied-not-done"]}
    ]
    o = stories["o"][1]
    assert o["job"] is None and o["redrives"] == [] and o["inbox"]["qty"] == 4
    assert o["audit"] == {
        "stage": "orphan",
        "flags": [
            {
                "flag": "orphan-inbox-row",
                "kind": "violation",
                "why": ops.VIOLATIONS["orphan-inbox-row"],
            }
        ],
    }
    assert missing == (404, {"error": "no job 'zz' in the queue or the sink DB"})
    assert page[0] == 200 and page[1]["Content-Type"].startswith("text/html")
    assert Page(page[2].decode()).references == ["data:,"]  # parses; nothing from elsewhere
    assert Page(missing_page[2].decode()).ids >= {"said", "job-id", "story"}
    assert b'id="job-id"' in page[2] and "script-src 'sha256-" in page[1]["Content-Security-Policy"]
    assert missing_page[0] == 404 and missing_page[1]["Content-Type"].startswith("text/html")
    assert b"no job &#x27;zz&#x27; in the queue or the sink DB</p>" in missing_page[2]


@pytest.mark.parametrize(
    ("traceparent", "expected"),
    [
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01", TRACE_ID),
        (f"01-{TRACE_ID}-00f067aa0ba902b7-00", TRACE_ID),  # a later version, not sampled
        (f"ff-{TRACE_ID}-00f067aa0ba902b7-01", None),  # version ff is invalid
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),  # so are all-zero ids
        (f"00-{TRACE_ID}-{'0' * 16}-01", None),
        (f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01", None),  # lower-case hex only
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01\n", None),
        (f"00-{TRACE_ID[:-1]}-00f067aa0ba902b7-01", None),
        (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # a blob
        (17, None),
    ],
)
def test_a_trace_id_only_from_a_valid_traceparent(dbs, traceparent, expected):
    queue, _ = dbs
    add_traces(queue, [("d", traceparent)])
    with readers.read_only(queue, "jobs") as con:
        assert reads.run(con, inspect.trace_id("d", on_sqlite=True)) == expected
        assert reads.run(con, inspect.trace_id("a", on_sqlite=True)) is None  # no row


@pytest.mark.process
def test_without_a_sink_or_a_trace_table_there_is_neither(dbs, tmp_path):
    queue, _ = dbs
    with dashboard(queue, log=tmp_path / "log") as url:
        status, story = job(url, "d")
        assert status == 200 and story["trace_id"] is None
        assert story["sink_db"] is False and story["inbox"] is None and story["audit"] is None
        assert job(url, "zz") == (404, {"error": "no job 'zz' in the queue"})
        add_traces(queue, [("d", f"00-{TRACE_ID}-00f067aa0ba902b7-01")])  # tracing turned on
        assert job(url, "d")[1]["trace_id"] == TRACE_ID


HOSTILE = [
    "x" * 65,
    "x" * 4000,
    "%ff%fe",
    "%c0%af",
    "%00",
    "a%00b",
    "d%0a",  # a trailing newline: not an id
    "%20d",
    "a%2Fb",
    "..%2F..%2Fqueue.db",
    "a'%20OR%20'1'='1",
    "d';DROP%20TABLE%20jobs;--",
    "%27%3B--",
    "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
    "<script>alert(1)</script>",
    "%E2%80%AEd",
    "%u0064",
    "%",
    "%%",
    "d%3F",
    "\u00e9",
]


@pytest.mark.process
def test_hostile_ids_are_a_400_or_404_and_nothing_is_written(dbs, tmp_path):
    queue, sink = dbs
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in dbs}
    files = set(os.listdir(queue.parent))
    log = tmp_path / "log"
    with dashboard(queue, "--sink-db", sink, log=log) as url:
        for hostile in HOSTILE:
            for prefix in ("/api/jobs/", "/jobs/"):
                line = raw(url, get((prefix + hostile).encode()))
                assert line.split(b" ")[1] in (b"400", b"404"), (prefix + hostile, line)
                path = prefix + urllib.parse.quote(hostile, safe="%/")
                status, _, body = request(url, path)
                assert status in (400, 404), (path, status)
                if status == 400 and prefix == "/api/jobs/":
                    assert json.loads(body) == {"error": inspect.BAD_ID}, path
                elif status == 400:
                    assert inspect.BAD_ID.replace("'", "&#x27;").encode() in body, path
        body = request(url, "/jobs/%3Cscript%3Ealert(1)%3C%2Fscript%3E")[2]
        assert b"<script>alert" not in body
        assert job(url, "d")[0] == 200 and state(url)["error"] is None  # still serving
        with locked(sink):  # a writer's lock outlasting the wait: a 503 that says so
            status, answer = job(url, "d")
            page = request(url, "/jobs/d")
        assert status == 503 and "is locked by another process" in answer["error"]
        assert page[0] == 503 and b"is locked by another process" in page[2]
        assert job(url, "d")[0] == 200
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in dbs} == before
    assert set(os.listdir(queue.parent)) == files | {"log"}  # no journal, no WAL


@pytest.mark.process
def test_only_get_on_the_job_routes_behind_the_host_check_and_token(dbs, tmp_path):
    queue, _ = dbs
    auth = {"Authorization": "Bearer s3cret"}
    with dashboard(queue, "--auth-token", "s3cret", log=tmp_path / "log") as url:
        for path in ("/jobs/d", "/api/jobs/d", "/api/jobs/zz", "/api/jobs/%00"):
            assert request(url, path)[0] == 401, path
            assert request(url, path, headers={**auth, "Host": "evil.example"})[0] == 421
        for path in ("/jobs/d", "/api/jobs/d"):
            assert request(url, path, "HEAD", headers=auth)[0] == 200
            for method in ("POST", "PUT", "DELETE"):
                assert request(url, path, method, headers=auth)[0] == 405
        for path in ("/jobs", "/jobs/", "/api/jobs", "/api/jobs/", "/api/jobs/d/x", "/jobs/d/"):
            assert request(url, path, headers=auth)[0] == 404, path


def busy_queue(queue, now):
    """Jobs finished in four of the last 60 minutes and one before, and live leases."""
    con = w.open_queue(queue)
    finished = {50: 3, 20: 1, 1: 2, 0: 4, 60: 5}  # in the minute that ended this long ago
    for ago, count in finished.items():
        for i in range(count):
            at = now - ago * 60_000 - 30_000
            w.enqueue(con, {"id": f"done{ago}-{i}", "qty": 1}, at, 1000)
            w.finish(con, w.claim(con, "w-0", at), "ok", at + 1)
    for i in range(14):
        w.enqueue(con, {"id": f"live-{i:02}", "qty": 1}, now, 60_000)
    for i in range(14):
        w.claim(con, "w-1" if i % 7 else "w-2", now, lease_ms=10_000 + i)
    con.close()
    return finished


@pytest.mark.process
def test_leases_by_owner_and_done_per_minute_over_the_last_hour(tmp_path):
    queue, now = tmp_path / "queue.db", epoch_ms() // 60_000 * 60_000 + 45_000  # (45 s in)
    finished = busy_queue(queue, now)
    with readers.read_only(queue, "jobs") as con:
        owners = reads.run(con, inspect.leases(now))
        hour = reads.run(con, inspect.done_per_minute(now))
    assert [(o["owner"], o["count"], len(o["jobs"])) for o in owners] == [
        ("w-1", 12, inspect.LEASES_LISTED),
        ("w-2", 2, 2),
    ]
    assert [j["id"] for j in owners[1]["jobs"]] == ["live-00", "live-07"]
    assert [j["left_ms"] for j in owners[1]["jobs"]] == [10_000, 10_007]
    assert [j["token"] for j in owners[0]["jobs"]] == [1] * inspect.LEASES_LISTED
    minutes = hour["minutes"]
    assert len(minutes) == inspect.HOUR_MINUTES and hour["done"] == 10  # not the one before
    this_minute = now - 45_000  # the clock's minutes: the last one is the current one
    assert [m["at_ms"] for m in minutes] == [this_minute - (59 - i) * 60_000 for i in range(60)]
    counts = {59 - i: m["done"] for i, m in enumerate(minutes) if m["done"]}
    assert counts == {ago: finished[ago] for ago in (50, 20, 1, 0)}
    assert minutes[-2]["per_s"] == round(2 / 60, 2)
    with readers.read_only(queue, "jobs") as con:
        # Unchanged data reads the same all minute long (a stable peak on the dashboard)...
        later = reads.run(con, inspect.done_per_minute(now + 14_999))
        assert later["minutes"] == minutes
        # ...and a job finished on a clock ahead counts in the current minute.
        assert reads.run(con, inspect.done_per_minute(now - 40_000))["minutes"][-1]["done"] == 4
    with dashboard(queue, log=tmp_path / "log") as url:
        shown = until(lambda: (seen := state(url))["hour"] and seen)
    with readers.read_only(queue, "jobs") as con:
        assert shown["leases"] == reads.run(con, inspect.leases(shown["at_ms"]))
        assert shown["hour"] == reads.run(con, inspect.done_per_minute(shown["hour"]["at_ms"]))


def test_the_inspector_reads_postgresql(pg_db, tmp_path):
    url = pg_db()
    ops.enqueue_all(url, [{"id": "p-1", "qty": 3}, {"id": "p-2", "qty": 1}])
    with sink_process(url) as sink, sessions.open_session(url) as store:  # one inbox, one DB
        send = HttpSender(sink)
        assert send({"id": "p-1", "qty": 3}, token=7) is True  # a token never issued
        ticket = store.run(partial(w.plan_claim, "pg-w", epoch_ms(), 60_000))
        assert send({"id": "p-1", "qty": 3}, token=ticket["token"]) is True
        assert store.run(partial(w.plan_finish, ticket, "ok", epoch_ms())) == "done"
        store.run(partial(w.plan_claim, "pg-w", epoch_ms(), 60_000))  # p-2: leased
    with dashboard(url, "--sink-db", url, log=tmp_path / "log") as base:
        status, story = job(base, "p-1")
        assert status == 200 and story["trace_id"] is None  # no trace table
        with psycopg.connect(url, autocommit=True) as con:
            con.execute(TRACES)
            con.execute(
                "INSERT INTO asnackq_job_traces VALUES (%s, %s)",
                ("p-1", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),
            )
        traced = job(base, "p-1")[1]
        missing, hostile = job(base, "zz"), job(base, "d';DROP%20TABLE%20jobs;--")
        shown = state(base)
    assert story["job"]["status"] == "done" and story["job"]["token"] == 1
    assert story["inbox"]["first_token"] == 7 and story["inbox"]["last_token"] == 1
    assert story["inbox"]["deliveries"] == 2
    assert [f["flag"] for f in story["audit"]["flags"]] == ["token-never-issued"]
    assert traced["trace_id"] == TRACE_ID
    assert missing[0] == 404 and hostile[0] == 400
    assert shown["hour"]["done"] == 1
    assert [(o["owner"], o["count"], [j["id"] for j in o["jobs"]]) for o in shown["leases"]] == [
        ("pg-w", 1, ["p-2"])
    ]


async def test_async_reads_of_sqlite_files_go_through_aiosqlite(dbs, tmp_path, monkeypatch):
    """The dashboard's sampler and job look-up, and a queue's foreign-file check at open, read
    SQLite files on aiosqlite's own thread: none of them hands sqlite3 to a worker thread of
    the event loop (``asyncio.to_thread``, ``run_in_executor``); their answers are the same
    read plans the commands run."""
    import asyncio

    from asnackq.aio import AsyncQueue
    from asnackq.ops.watcher import Watcher

    def refused(*args, **kwargs):
        raise AssertionError("a thread of the event loop's executor was asked to read")

    monkeypatch.setattr(asyncio, "to_thread", refused)
    monkeypatch.setattr(asyncio.get_running_loop(), "run_in_executor", refused)
    queue, sink = dbs
    watcher = Watcher(queue, sink)
    await watcher.sample()
    with readers.read_only(queue, "jobs") as con:
        assert (
            watcher.state["stats"]["by_status"]
            == ops.stats(con, watcher.state["at_ms"])["by_status"]
        )
    assert watcher.state["audit"]["violations"] == ops.audit(queue, sink, epoch_ms()).violations
    story = await watcher.look_up("d")
    assert story is not None and story["job"]["status"] == "done" and story["inbox"]["qty"] == 2
    assert await watcher.look_up("zz") is None
    other = tmp_path / "app.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    con.close()
    with pytest.raises(ValueError, match="holds other tables"):
        async with AsyncQueue.open(other):
            pass
    async with AsyncQueue.open(queue) as opened:  # its own file: opened
        assert (await opened.read("SELECT count(*) FROM jobs"))[0][0] == 5
