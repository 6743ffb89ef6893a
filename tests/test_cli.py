"""The ``asnackq`` command through its real entry point (``python -m asnackq``) on real files."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import time

import pytest
from aiohttp import web
from rich.console import Console

from asnackq.core import worker as w
from asnackq.core.inbox import SINK_SCHEMA
from asnackq.dispatch.traces import read_traces
from asnackq.http_sink import SinkConfig, make_app
from asnackq.lab import LabConfig, procs, run_lab
from asnackq.lab.evidence import verify
from asnackq.lab.procs import PIPE, Replicas

from .conftest import rows
from .logs import problems
from .sinks import add_records, serving


def asnackq(*args, stdin=None, timeout=60):
    return subprocess.run(
        procs.command(*args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


def ok(*args, **kwargs):
    run = asnackq(*args, **kwargs)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout) if "--json" in args else run.stdout


def fails(*args, code=1, **kwargs):
    """Run a command that must fail with one clear stderr line and no traceback."""
    run = asnackq(*args, **kwargs)
    assert run.returncode == code, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    said = problems(run.stderr)  # (a worker's state changes aside: started, stopped, ...)
    assert said.count("\n") == 1, run.stderr
    assert said.startswith(f"asnackq {args[0]}: " if code == 1 else "asnackq")
    return said


@pytest.fixture
def queue(tmp_path):
    path = tmp_path / "queue.db"
    assert ok("init", path, "--json") == {"queue": str(path), "created": True, "jobs": 0}
    return path


def lines(*records):
    return "".join(json.dumps(record) + "\n" for record in records)


@pytest.fixture
def sink_proc(tmp_path):
    """An ``asnackq sink`` child process; its URL; stopped by SIGTERM at the end (exit 0)."""
    with Replicas(tmp_path / "sink.db", 1) as sinks:
        yield sinks.urls[0], tmp_path / "sink.db"
    assert sinks.codes == [0]


# --- init and enqueue --------------------------------------------------------------------


@pytest.mark.process
def test_help_everywhere_and_usage_errors_exit_2():
    for command in (
        "init",
        "enqueue",
        "work",
        "stats",
        "dead",
        "redrive",
        "history",
        "audit",
        "purge",
        "lab",
        "sink",
        "demo",
    ):
        assert "usage: asnackq" in ok(command, "--help")
    fails("work", code=2)  # QUEUE and --sink missing
    fails("stats", "q.db", "--bogus", code=2)


@pytest.mark.process
def test_init_is_idempotent_and_keeps_jobs(queue):
    ok("enqueue", queue, "--id", "a", "--qty", "2")
    assert ok("init", queue, "--json") == {"queue": str(queue), "created": False, "jobs": 1}


@pytest.mark.process
def test_enqueue_one_then_duplicate_then_conflict(queue):
    assert ok("enqueue", queue, "--id", "a", "--qty", "2", "--json")["inserted"] == 1
    assert ok("enqueue", queue, "--id", "a", "--qty", "2", "--json")["present"] == 1
    before = rows(queue)
    assert "exists with qty 2, not 3" in fails("enqueue", queue, "--id", "a", "--qty", "3")
    assert rows(queue) == before


@pytest.mark.process
def test_enqueue_json_lines_from_a_file_and_stdin_with_options(queue, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(
        lines(
            *({"id": f"j{i}", "qty": i % 9 + 1} for i in range(1500)),
            {"id": "x", "qty": 1, "ttl_ms": 500, "max_attempts": 9},
        )
        + "\n"
    )
    assert ok("enqueue", queue, source, "--max-attempts", "4", "--json") == {
        "inserted": 1501,
        "present": 0,
        "conflicts": 0,
        "conflicting": [],
    }
    con = sqlite3.connect(queue)
    assert con.execute(
        "SELECT max_attempts, deadline - available_at FROM jobs WHERE id = 'x'"
    ).fetchone() == (9, 500)
    assert con.execute("SELECT max_attempts FROM jobs WHERE id = 'j7'").fetchone() == (4,)
    con.close()
    got = ok(
        "enqueue",
        queue,
        "-",
        "--json",
        stdin=lines({"id": "j1", "qty": 2}, {"id": "new", "qty": 5}),
    )
    assert got == {"inserted": 1, "present": 1, "conflicts": 0, "conflicting": []}


@pytest.mark.process
def test_enqueue_reports_conflicts_with_exit_1_and_inserts_the_rest(queue):
    ok("enqueue", queue, "--id", "a", "--qty", "2")
    run = asnackq(
        "enqueue", queue, "-", "--json", stdin=lines({"id": "a", "qty": 9}, {"id": "b", "qty": 1})
    )
    assert run.returncode == 1
    assert json.loads(run.stdout)["inserted"] == 1 and json.loads(run.stdout)["conflicts"] == 1
    assert "conflict: job 'a' exists with qty 2, not 9" in run.stderr
    assert w.check_event({"id": "a", "qty": 2})  # the conflicting row is kept as it was
    con = sqlite3.connect(queue)
    assert con.execute("SELECT qty FROM jobs WHERE id = 'a'").fetchone() == (2,)
    con.close()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"id": "ok", "qty": 1}\n{"id": "b c", "qty": 1}\n', "stdin:2: event id"),
        ('{"id": "ok", "qty": 1}\nnot json\n', "stdin:2:"),
        ("[1, 2]\n", "stdin:1: each line must be a JSON object"),
        ('{"id": "a", "qty": 1, "qtty": 2}\n', "stdin:1: unknown keys ['qtty']"),
        ('{"id": "a", "qty": 1, "ttl_ms": 0}\n', "stdin:1: ttl_ms"),
    ],
)
@pytest.mark.process
def test_enqueue_bad_line_changes_nothing(queue, text, why):
    before = rows(queue)
    assert why in fails("enqueue", queue, "-", stdin=text)
    assert rows(queue) == before


@pytest.mark.process
def test_commands_on_a_missing_or_foreign_file_fail_clearly(tmp_path):
    missing = tmp_path / "nope.db"
    assert "no queue at" in fails("enqueue", missing, "--id", "a", "--qty", "1")
    assert "no queue at" in fails("stats", missing)
    assert "no queue at" in fails("work", missing, "--sink", "http://127.0.0.1:9/events")
    assert not missing.exists()
    other = tmp_path / "other.db"
    sqlite3.connect(other).close()
    assert "is not a queue DB (no jobs table)" in fails("dead", other)
    text = tmp_path / "text.db"
    text.write_text("hello, this is not SQLite at all" * 10)
    assert "is not a queue DB: file is not a database" in fails("stats", text)


# --- stats, dead, redrive, history ----------------------------------------------------------


def make_dead(queue):
    """Three dead jobs: two exhausted, one by deadline; one done and one pending."""
    con = w.open_queue(queue)
    now = time.time_ns() // 1_000_000 - 10_000
    for job_id in ("e1", "e2", "ok", "wait"):
        w.enqueue(con, {"id": job_id, "qty": 3}, now, 60_000, 1)
    w.enqueue(con, {"id": "late", "qty": 4}, now, 1, 3)
    for _ in range(3):
        ticket = w.claim(con, "ops", now + 5, 1000)
        w.finish(con, ticket, "ok" if ticket["id"] == "ok" else "retry", now + 6)
    con.close()


@pytest.mark.process
def test_stats_and_dead(queue):
    make_dead(queue)
    stats = ok("stats", queue, "--json")
    assert stats["by_status"] == {"pending": 1, "leased": 0, "done": 1, "dead": 3}
    assert stats["dead_by_reason"] == {"exhausted": 2, "deadline": 1}
    assert stats["attempts"] == {"0": 2, "1": 3}
    assert stats["oldest_pending_ms"] >= 10_000 and stats["expired_leases"] == 0
    dead = ok("dead", queue, "--json")
    assert [(d["id"], d["reason"], d["attempts"], d["token"]) for d in dead] == [
        ("e1", "exhausted", 1, 1),
        ("e2", "exhausted", 1, 1),
        ("late", "deadline", 0, 0),
    ]
    assert [d["id"] for d in ok("dead", queue, "--reason", "deadline", "--json")] == ["late"]
    assert "exhausted" in ok("dead", queue) and "dead: deadline" in ok("stats", queue)


@pytest.mark.process
def test_stats_shows_expired_leases(queue):
    con = w.open_queue(queue)
    now = time.time_ns() // 1_000_000 - 5_000
    w.enqueue(con, {"id": "held", "qty": 1}, now, 60_000)
    w.claim(con, "gone", now, 100)
    con.close()
    stats = ok("stats", queue, "--json")
    assert stats["expired_leases"] == 1
    assert stats["expired"][0]["id"] == "held" and stats["expired"][0]["owner"] == "gone"


@pytest.mark.process
def test_redrive_one_and_by_reason_each_audited(queue):
    make_dead(queue)
    assert ok("redrive", queue, "late", "--ttl-ms", "5000", "--note", "fixed-clock", "--json") == {
        "redriven": 1,
        "jobs": [{"id": "late", "redriven": True}],
    }
    got = ok(
        "redrive", queue, "--reason", "exhausted", "--ttl-ms", "5000", "--note", "bulk", "--json"
    )
    assert got["redriven"] == 2
    history = ok("history", queue, "e2", "--json")
    assert history["status"] == "pending" and history["token"] == 1
    assert [(r["token"], r["note"]) for r in history["redrives"]] == [(1, "bulk")]
    con = sqlite3.connect(queue)
    assert con.execute("SELECT id, note FROM redrives ORDER BY seq").fetchall() == [
        ("late", "fixed-clock"),
        ("e1", "bulk"),
        ("e2", "bulk"),
    ]
    con.close()
    assert "bulk" in ok("history", queue, "e1")


@pytest.mark.process
def test_redrive_errors_change_nothing(queue):
    make_dead(queue)
    before = rows(queue)
    assert "is pending, not dead" in fails(
        "redrive", queue, "wait", "--ttl-ms", "10", "--note", "x"
    )
    assert "no job 'ghost'" in fails("redrive", queue, "ghost", "--ttl-ms", "10", "--note", "x")
    assert "give either one job ID or --reason" in fails(
        "redrive", queue, "--ttl-ms", "10", "--note", "x", code=2
    )
    assert "note" in fails(
        "redrive", queue, "--reason", "exhausted", "--ttl-ms", "10", "--note", "two words", code=2
    )
    assert "ttl_ms" in fails("redrive", queue, "e1", "--ttl-ms", "0", "--note", "x", code=2)
    fails("redrive", queue, "--reason", "tired", "--ttl-ms", "10", "--note", "x", code=2)
    assert "no job 'ghost'" in fails("history", queue, "ghost")
    assert rows(queue) == before


# --- work and audit, with a real sink process ------------------------------------------------


@pytest.mark.process
def test_work_until_empty_then_audit_is_clean(queue, sink_proc, tmp_path):
    url, sink_db = sink_proc
    ok("enqueue", queue, "-", stdin=lines(*({"id": f"j{i}", "qty": i % 5 + 1} for i in range(200))))
    summary = ok(
        "work",
        queue,
        "--sink",
        url,
        "--until-empty",
        "--concurrency",
        "16",
        "--owner",
        "cli-1",
        "--trace",
        tmp_path / "t.jsonl",
        "--json",
    )
    assert summary["done"] == 200 and summary["claimed"] == 200 and summary["owner"] == "cli-1"
    assert summary["stopped_by_signal"] is False
    trace = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert sorted(r["e"] for r in trace) == ["claim"] * 200 + ["finish"] * 200
    assert all(r["status"] == "done" for r in trace if r["e"] == "finish")
    audit = ok("audit", queue, "--sink-db", sink_db, "--json")
    assert audit["violations"] == 0 and audit["stages"] == {"done": 200}
    assert audit["stock"] == audit["inbox_qty_sum"] == sum(i % 5 + 1 for i in range(200))
    one = ok("audit", queue, "--sink-db", sink_db, "--id", "j7", "--json")["job"]
    assert one["stage"] == "done" and one["inbox"]["qty"] == 3
    assert one["inbox"]["first_token"] == one["job"]["token"] == 1
    assert "no violations" in ok("audit", queue, "--sink-db", sink_db)


@pytest.mark.process
def test_a_stopped_sinks_file_is_read_without_writing(queue, tmp_path):
    """While it runs, the sink's inbox is in WAL mode; stopped (SIGTERM), it leaves one file
    in the rollback journal's format: read-only readers create no -wal or -shm next to it,
    and a reader that may not write the directory (another user, a read-only copy) reads it."""
    sink_db = tmp_path / "sink.db"
    ok("enqueue", queue, "-", stdin=lines(*({"id": f"j{i}", "qty": 1} for i in range(20))))
    with Replicas(sink_db, 1) as sinks:
        ok("work", queue, "--sink", sinks.urls[0], "--until-empty", "--concurrency", "4")
        assert sink_db.read_bytes()[18:20] == b"\x02\x02"  # WAL
    assert sinks.codes == [0]
    assert sorted(os.listdir(tmp_path)) == ["queue.db", "sink.db"]
    assert sink_db.read_bytes()[18:20] == b"\x01\x01"  # the rollback journal's format
    assert ok("audit", queue, "--sink-db", sink_db, "--json")["stages"] == {"done": 20}
    assert sorted(os.listdir(tmp_path)) == ["queue.db", "sink.db"]


@pytest.mark.process
def test_audit_flags_attention_and_catches_a_deleted_inbox_row(queue, sink_proc):
    url, sink_db = sink_proc
    ok("enqueue", queue, "-", stdin=lines(*({"id": f"j{i}", "qty": 2} for i in range(20))))
    ok("work", queue, "--sink", url, "--until-empty", "--concurrency", "4")
    con = w.open_queue(queue)  # one job leased and applied, its ACK not yet in
    now = time.time_ns() // 1_000_000
    w.enqueue(con, {"id": "later", "qty": 1}, now, 60_000)
    assert w.claim(con, "slow", now, 60_000)["token"] == 1
    con.close()
    sink = sqlite3.connect(sink_db)
    add_records(sink, [("later", 1, 1, 1, 1, 0, 0)])
    sink.execute("UPDATE stock SET total = total + 1")
    sink.commit()
    audit = ok("audit", queue, "--sink-db", sink_db, "--json")
    assert audit["violations"] == 0 and audit["flags"]["applied-not-done"] == 1
    assert audit["listed"]["attention"][0]["id"] == "later"
    for table in ("asnackq_webhook_inbox", "stock_moves"):
        sink.execute(f"DELETE FROM {table} WHERE id = 'j3'")
    sink.commit()
    sink.close()
    run = asnackq("audit", queue, "--sink-db", sink_db, "--json")
    assert run.returncode == 1
    audit = json.loads(run.stdout)
    assert audit["flags"]["done-without-inbox-row"] == 1
    assert audit["flags"]["stock-mismatch"] == 1
    assert audit["listed"]["violations"][0]["id"] == "j3"
    human = asnackq("audit", queue, "--sink-db", sink_db)
    assert human.returncode == 1 and "VIOLATIONS" in human.stdout and "j3" in human.stdout
    # --id judges that job alone: a sound job passes although the queue has violations.
    one = asnackq("audit", queue, "--sink-db", sink_db, "--id", "j5")
    assert one.returncode == 0 and "no violations" in one.stdout, one.stdout
    assert "j3" not in one.stdout and "1 delivery" in one.stdout
    assert ok("audit", queue, "--sink-db", sink_db, "--id", "j5", "--json")["violations"] == 0
    bad = asnackq("audit", queue, "--sink-db", sink_db, "--id", "j3")
    assert bad.returncode == 1 and "VIOLATION: done-without-inbox-row" in bad.stdout
    assert "stock" not in bad.stdout  # (the whole queue's verdict is not this job's)
    assert "no job 'zz' in the queue or the sink" in fails(
        "audit", queue, "--sink-db", sink_db, "--id", "zz"
    )


@pytest.mark.process
def test_audit_catches_qty_mismatch_orphans_and_unissued_tokens(queue, tmp_path):
    sink_db = tmp_path / "sink.db"
    con = w.open_queue(queue)
    now = time.time_ns() // 1_000_000
    w.enqueue(con, {"id": "a", "qty": 2}, now, 60_000)
    w.enqueue(con, {"id": "b", "qty": 2}, now, 60_000)
    con.close()
    sink = sqlite3.connect(sink_db)
    for statement in SINK_SCHEMA:
        sink.execute(statement)
    sink.execute("UPDATE stock SET total = 12")
    add_records(
        sink, [("a", 5, 1, 1, 1, 0, 0), ("b", 2, 7, 7, 1, 0, 0), ("zzz", 5, None, None, 1, 0, 0)]
    )
    sink.commit()
    sink.close()
    run = asnackq("audit", queue, "--sink-db", sink_db, "--json")
    assert run.returncode == 1
    flags = json.loads(run.stdout)["flags"]
    assert (
        flags["qty-mismatch"],
        flags["orphan-inbox-row"],
        flags["token-never-issued"],
        flags["stock-mismatch"],
    ) == (1, 1, 2, 0)
    assert "no sink DB at" in fails("audit", queue, "--sink-db", tmp_path / "none.db")


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_work_stops_cleanly_on_a_signal(queue, tmp_path, signum):
    """SIGTERM or Ctrl-C while sends are in flight: stop claiming, finish them, exit 0.

    The sink answers 8 requests, then holds the next ones at a gate: the signal finds
    sends in flight (forced, not timed); the gate opens after it."""
    in_flight, gate = asyncio.Event(), asyncio.Event()
    arrived = 0

    @web.middleware
    async def hold(request, handler):
        nonlocal arrived
        arrived += 1
        if arrived > 8:
            in_flight.set()
            await gate.wait()
        return await handler(request)

    app = make_app(SinkConfig(tmp_path / "sink.db"))
    app.middlewares.append(hold)
    await asyncio.to_thread(
        ok, "enqueue", queue, "-", stdin=lines(*({"id": f"j{i}", "qty": 1} for i in range(500)))
    )
    async with serving(app) as sink:
        with procs.started(
            procs.command("work", queue, "--sink", sink.url, "--concurrency", "8", "--json"),
            stdout=PIPE,
            stderr=PIPE,
        ) as work:
            await asyncio.wait_for(in_flight.wait(), 30)
            work.send_signal(signum)
            gate.set()
            out, err = await asyncio.to_thread(work.communicate, timeout=30)
    assert work.returncode == 0, err
    summary = json.loads(out)
    assert summary["stopped_by_signal"] is True and summary["errors"] == 0
    assert summary["claimed"] == summary["done"] < 500
    stats = await asyncio.to_thread(ok, "stats", queue, "--json")
    assert stats["by_status"]["leased"] == 0  # in-flight sends were finished
    assert stats["by_status"]["done"] == summary["done"]


@pytest.mark.process
def test_work_refuses_a_remote_sink(queue):
    assert "non-loopback" in fails("work", queue, "--sink", "http://example.com/events", code=2)
    assert "prefetch must be" in fails(
        "work", queue, "--sink", "http://127.0.0.1:9/e", "--prefetch", "-1", code=2
    )
    for bad in ("-1", "1001", "0.5", "ten"):
        assert "--gather-ms: must be an int in 0..1000" in fails(
            "work", queue, "--sink", "http://127.0.0.1:9/e", "--gather-ms", bad, code=2
        )


@pytest.mark.process
def test_work_without_gathering(queue, sink_proc):
    url, _ = sink_proc
    ok("enqueue", queue, "-", stdin=lines(*({"id": f"g{i}", "qty": 1} for i in range(30))))
    summary = ok("work", queue, "--sink", url, "--until-empty", "--gather-ms", "0", "--json")
    assert summary["done"] == summary["claimed"] == 30 and summary["commits"] >= 1


@pytest.mark.process
def test_work_with_a_fixed_prefetch(queue, sink_proc):
    url, _ = sink_proc
    ok("enqueue", queue, "-", stdin=lines(*({"id": f"p{i}", "qty": 1} for i in range(30))))
    summary = ok(
        "work",
        queue,
        "--sink",
        url,
        "--until-empty",
        "--concurrency",
        "3",
        "--prefetch",
        "0",
        "--json",
    )
    assert summary["done"] == summary["claimed"] == 30


# --- lab --------------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
def test_lab_with_kills_and_faults_finds_no_violation(tmp_path):
    out = tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--jobs",
        "300",
        "--processes",
        "2",
        "--concurrency",
        "4",
        "--delay-ms",
        "50",
        "--fail-rate",
        "0.1",
        "--drop-rate",
        "0.1",
        "--kill-every",
        "1.0",
        "--max-attempts",
        "16",
        "--seed",
        "7",
        "--lease-ms",
        "800",
        "--send-timeout-s",
        "0.4",
        "--dir",
        tmp_path / "lab",
        "--json",
        out,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["violations"] == []
    # One SIGKILL a second: how many depends on the run's length; each one is replaced.
    assert result["kills"] >= 1 and result["workers_started"] == 2 + result["kills"]
    assert sum(result["statuses"].values()) == 300
    assert result["sink_failed"] > 0 and result["sink_dropped"] > 0
    assert result["duplicates"] > 0 and result["latency_ms"]["samples"] > 0
    assert result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    assert "violations" in run.stdout and "p50 / p99" in run.stdout


@pytest.mark.process
def test_lab_verification_catches_a_lost_effect(tmp_path):
    """The lab's own checks fail on corrupted evidence (and the command exits 1 then)."""
    directory = tmp_path / "lab"
    config = LabConfig(jobs=50, processes=1, concurrency=4, directory=directory)
    with open(os.devnull, "w") as devnull:
        result = run_lab(config, Console(file=devnull))
    assert result.evidence.violations == []
    sink = sqlite3.connect(directory / "sink.db")
    sink.execute("DELETE FROM asnackq_webhook_inbox WHERE id = 'lab-0000003'")
    sink.commit()
    sink.close()
    con = sqlite3.connect(directory / "queue.db")
    qty = dict(con.execute("SELECT id, qty FROM jobs"))
    con.close()
    traces = read_traces(directory)
    traces.append({**next(r for r in traces if r["e"] == "claim"), "owner": "ghost"})
    found = verify(
        directory / "queue.db",
        directory / "sink.db",
        qty,
        traces,
        {"applied": 50, "requests": 50, "duplicates": 0},
    )
    text = "\n".join(found.violations)
    assert "done-without-inbox-row" in text and "token reused" in text
    assert "applied 50 times for 49 inbox rows" in text


@pytest.mark.process
def test_lab_refuses_bad_settings():
    assert "below the lease" in fails("lab", "--lease-ms", "500", "--send-timeout-s", "1", code=2)
    fails("lab", "--fail-rate", "2", code=2)
