"""Liveness through the command line: outages outlasted, honest summaries, product ranges."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess

import pytest
from rich.console import Console

from asnackq.dispatch.traces import read_traces
from asnackq.lab import LabConfig, run_lab
from asnackq.lab.evidence import verify
from asnackq.lab.procs import PIPE, kill, start_sink, stop, worker

from .conftest import rows
from .sinks import dead_port
from .test_cli import asnackq, fails, ok


@pytest.fixture
def queue(tmp_path):
    path = tmp_path / "queue.db"
    ok("init", path)
    return path


def enqueue_many(queue, count, *options):
    text = "".join(json.dumps({"id": f"j-{i}", "qty": i % 9 + 1}) + "\n" for i in range(count))
    ok("enqueue", queue, "-", *options, "--json", stdin=text)


@pytest.mark.process
def test_work_outlasts_a_sink_that_is_away_then_back(queue, tmp_path):
    enqueue_many(queue, 300, "--max-attempts", "3")
    port = dead_port()
    work = worker(
        queue,
        f"http://127.0.0.1:{port}/events",
        "--until-empty",
        "--json",
        "--concurrency",
        "32",
        "--lease-ms",
        "2000",
        "--timeout-s",
        "0.5",
        "--breaker-max-ms",
        "300",
        stdout=PIPE,
        stderr=PIPE,
    )
    try:
        # The outage lasts 2.5 s (its length is the point): nothing listens, the worker waits.
        with contextlib.suppress(subprocess.TimeoutExpired):
            work.wait(timeout=2.5)
        assert work.poll() is None
        sink, _ = start_sink(tmp_path / "sink.db", port=port)
        try:
            out, err = work.communicate(timeout=60)
        finally:
            stop(sink)
    finally:
        kill(work)
    assert work.returncode == 0, err
    summary = json.loads(out)
    assert (summary["done"], summary["dead"], summary["retried"]) == (300, 0, 0)
    assert summary["outages"] >= 1 and summary["paused_ms"] >= 1000
    assert summary["breaker"]["max_ms"] == 300 and summary["retry"]["base_ms"] == 100
    assert {(r[3], r[4]) for r in rows(queue) if len(r) > 3} == {("done", 1)}


@pytest.mark.process
def test_work_exits_1_when_jobs_die_unanswered_unless_accepted(queue):
    enqueue_many(queue, 5, "--ttl-ms", "400")
    url = f"http://127.0.0.1:{dead_port()}/events"
    args = (
        "work",
        queue,
        "--sink",
        url,
        "--until-empty",
        "--json",
        "--lease-ms",
        "300",
        "--timeout-s",
        "0.1",
    )
    why = fails(*args)
    assert "5 jobs ended dead that the sink never rejected" in why and "deadline 5" in why
    assert why.count("\n") == 1
    enqueue_many(queue, 3, "--ttl-ms", "100")  # j-0..j-2 are known: nothing new
    ok("redrive", queue, "--reason", "deadline", "--ttl-ms", "300", "--note", "again")
    summary = ok(*args, "--accept-dead")
    assert (summary["dead"], summary["dead_deadline"], summary["done"]) == (5, 5, 0)


@pytest.mark.process
def test_product_ranges_on_the_command_line(queue):
    day = 24 * 3600 * 1000
    assert (
        ok("enqueue", queue, "--id", "a", "--qty", "1", "--ttl-ms", day, "--json")["inserted"] == 1
    )
    before = rows(queue)
    fails("enqueue", queue, "--id", "b", "--qty", "1", "--ttl-ms", 30 * day + 1, code=2)
    fails("work", queue, "--sink", "http://127.0.0.1:9/events", "--lease-ms", 3_600_001, code=2)
    fails("work", queue, "--sink", "http://127.0.0.1:9/events", "--retry-cap-ms", 50, code=2)
    assert rows(queue) == before
    con = sqlite3.connect(queue)
    (deadline, available) = con.execute("SELECT deadline, available_at FROM jobs").fetchone()
    con.close()
    assert deadline - available == day


@pytest.mark.process
@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
def test_lab_with_a_slow_sink_near_the_lease_ends_every_job_done(tmp_path):
    out = tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--jobs",
        "200",
        "--processes",
        "2",
        "--concurrency",
        "16",
        "--delay-ms",
        "600",
        "--lease-ms",
        "1000",
        "--send-timeout-s",
        "0.9",
        "--json",
        out,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["statuses"] == {"done": 200} and result["liveness_failures"] == []
    assert result["done_per_s"] > 0 and result["requests"] == 200


@pytest.mark.process
@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
def test_lab_accepts_dead_jobs_only_when_the_faults_leave_no_way(tmp_path):
    out = tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--jobs",
        "20",
        "--processes",
        "1",
        "--concurrency",
        "4",
        "--fail-rate",
        "1.0",
        "--lease-ms",
        "300",
        "--send-timeout-s",
        "0.2",
        "--json",
        out,
        timeout=120,
    )
    result = json.loads(out.read_text())
    # Every send finds a 503: no attempt is charged, the jobs end dead by their deadline,
    # which the lab sets short (ten leases) because the faults leave no way to deliver.
    assert run.returncode == 0, run.stdout + run.stderr
    assert result["statuses"] == {"dead": 20} and result["dead_reasons"]["deadline"] == 20
    assert result["liveness"]["expected"] is True and result["liveness_failures"] == []
    assert result["violations"] == []


@pytest.mark.process
def test_lab_flags_jobs_that_died_without_being_sent(tmp_path):
    directory = tmp_path / "lab"
    with open(os.devnull, "w") as devnull:
        result = run_lab(
            LabConfig(jobs=20, processes=1, concurrency=4, directory=directory),
            Console(file=devnull),
        )
    assert result.liveness_failures == [] and result.evidence.statuses == {"done": 20}
    con = sqlite3.connect(directory / "queue.db")
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
        " available_at, deadline, reason) VALUES ('late', 1, 'dead', 0, 3, 0, 1, 2,"
        " 'deadline')"
    )
    con.commit()
    qty = dict(con.execute("SELECT id, qty FROM jobs"))
    con.close()
    found = verify(
        directory / "queue.db",
        directory / "sink.db",
        qty,
        read_traces(directory),
        {"applied": 20, "requests": 20, "duplicates": 0},
    )
    assert found.liveness.never_sent == 1 and found.liveness.examples == ["late"]
