"""``asnackq dashboard`` as a real process on 127.0.0.1 port 0: what it shows (the numbers of
``ops.stats`` and ``ops.audit``), what it refuses, and that it never writes."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asnackq import ops
from asnackq.cli import main
from asnackq.core import worker as w
from asnackq.core.inbox import SINK_SCHEMA
from asnackq.core.worker import epoch_ms
from asnackq.lab import procs
from asnackq.lab.procs import PIPE
from asnackq.ops.watcher import Watcher
from asnackq.store import readers

from .sinks import add_records
from .test_cli import fails, ok


@pytest.fixture
def dbs(tmp_path):
    """A queue with a job in every state, and a sink DB that knows two of them.

    a: leased, its lease expired; b: dead, redriven (pending, one redrive record);
    c: dead (permanent); d: done (applied, delivered twice); e: pending but applied.
    """
    queue, sink = tmp_path / "queue.db", tmp_path / "sink.db"
    now = epoch_ms()
    con = w.open_queue(queue)
    for i, name in enumerate("cdbae"):  # claims take the lowest seq
        w.enqueue(con, {"id": name, "qty": i + 1}, now - 100, 60_000)
    w.finish(con, w.claim(con, "w", now), "permanent", now)  # c
    w.finish(con, w.claim(con, "w", now), "ok", now)  # d
    w.finish(con, w.claim(con, "w", now), "permanent", now)  # b
    w.claim(con, "old-worker", now - 50, lease_ms=1)  # a
    w.redrive(con, "b", now, 60_000, "fixed")
    con.close()
    con = sqlite3.connect(sink)
    for statement in SINK_SCHEMA:
        con.execute(statement)
    add_records(con, [("d", 2, 1, 1, 2, 0, 0), ("e", 5, None, None, 1, 0, 0)])  # e: no token
    con.execute("UPDATE stock SET total = 7")
    con.commit()
    con.close()
    return queue, sink


@contextlib.contextmanager
def dashboard(*args):
    """A dashboard process; its base URL; stopped by SIGTERM (it must exit 0)."""
    proc = procs.start(procs.command("dashboard", *args), stdout=PIPE, stderr=PIPE)
    try:
        line = proc.stdout.readline()
        assert line.startswith("asnackq dashboard listening on http://127.0.0.1:"), (
            line + proc.communicate(timeout=30)[1]
        )  # a refusal: one line, exit 1
        yield line.split()[-1]
    finally:
        code = procs.stop(proc)[0]
    assert code == 0


def request(url, path="/", method="GET", headers=None):
    """(status, headers, body) of one request, whatever the status."""
    parts = urllib.parse.urlsplit(url)
    con = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        con.request(method, path, headers=headers or {})
        answer = con.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        con.close()


def state(url, **headers):
    status, _, body = request(url, "/api/state", headers=headers)
    assert status == 200
    return json.loads(body)


def until(probe, timeout=10):
    """Poll ``probe`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found or time.monotonic() > deadline:
            assert found, "not within the deadline"
            return found
        time.sleep(0.05)


@pytest.mark.process
def test_the_state_is_what_stats_and_audit_say(dbs):
    queue, sink = dbs
    with dashboard(queue, "--sink-db", sink) as url:
        shown = state(url)
        status, headers, page = request(url)
    with readers.read_only(queue, "jobs") as con:
        expected = ops.stats(con, shown["at_ms"])
    assert shown["error"] is None and shown["stats"] == expected
    assert expected["by_status"] == {"pending": 2, "leased": 1, "done": 1, "dead": 1}
    assert shown["stats"]["expired_leases"] == 1 and shown["stats"]["expired"][0]["id"] == "a"
    assert [(r["id"], r["note"]) for r in shown["redrives"]] == [("b", "fixed")]
    assert shown["inbox"] == {"effects_applied": 2, "deliveries": 3, "duplicates": 1, "stock": 7}
    audited = ops.audit(queue, sink, shown["audit"]["at_ms"], limit=20)
    assert shown["audit"]["flags"] == audited.flags
    assert shown["audit"]["attention"] == audited.listed["attention"]
    assert {e["id"] for e in shown["audit"]["attention"]} == {"a", "e"}
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'data-field="by_status.done"' in page
    assert "script-src 'sha256-" in headers["Content-Security-Policy"]


@pytest.mark.process
def test_metrics_are_the_queue_gauges(dbs):
    queue, _ = dbs
    with dashboard(queue) as url:
        status, headers, body = request(url, "/metrics")
        shown = state(url)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    jobs = {s.labels["status"]: s.value for s in families["asnackq_queue_jobs"].samples}
    assert jobs == {"pending": 2, "leased": 1, "done": 1, "dead": 1}
    dead = {s.labels["reason"]: s.value for s in families["asnackq_queue_dead_jobs"].samples}
    assert dead == {"exhausted": 0, "deadline": 0, "permanent": 1, "poison": 0}
    assert families["asnackq_queue_expired_leases"].samples[0].value == 1
    age = families["asnackq_queue_oldest_pending_age_seconds"]
    assert age.type == "gauge" and 0 < age.samples[0].value < 60
    assert shown["inbox"] is None and shown["audit"] is None  # no --sink-db


@pytest.mark.process
def test_only_get_on_its_own_routes(dbs):
    queue, _ = dbs
    with dashboard(queue) as url:
        for path in ("/", "/api/state", "/metrics"):
            assert request(url, path, "HEAD")[0] == 200
            for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
                status, headers, _ = request(url, path, method)
                assert status == 405 and headers["Allow"] in ("GET,HEAD", "HEAD,GET")
        for path in (
            "/api",
            "/api/state/x",
            "/index.html",
            "/favicon.ico",
            "/../queue.db",
            "/%2e%2e/queue.db",
            "/metrics/",
            "/" + "x" * 4000,
        ):
            assert request(url, path)[0] == 404, path
        assert request(url, "/" + "x" * 20_000)[0] in (400, 404, 414)  # over aiohttp's line
        assert state(url)["error"] is None  # still serving


@pytest.mark.process
def test_a_web_page_elsewhere_cannot_read_it(dbs):
    queue, _ = dbs
    with dashboard(queue) as url:
        port = urllib.parse.urlsplit(url).port
        for host in ("evil.example", f"evil.example:{port}", "10.0.0.1", "127.0.0.1.nip.io"):
            assert request(url, "/api/state", headers={"Host": host})[0] == 421, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert request(url, "/api/state", headers={"Host": host})[0] == 200, host


@pytest.mark.process
def test_an_auth_token_guards_every_route(dbs):
    queue, _ = dbs
    with dashboard(queue, "--auth-token", "s3cret") as url:
        for path in ("/", "/api/state", "/metrics", "/nope"):
            status, headers, _ = request(url, path)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
        basic = base64.b64encode(b"anyone:s3cret").decode()
        for good in ("Bearer s3cret", f"Basic {basic}"):
            assert request(url, "/api/state", headers={"Authorization": good})[0] == 200
        wrong = base64.b64encode(b"s3cret:nope").decode()
        for bad in (
            "Bearer s3cre",
            "Bearer s3cret2",
            "bearer s3cret",
            "s3cret",
            f"Basic {wrong}",
            "Basic !!!",
            "Basic " + base64.b64encode(b"\xff:s3cret").decode(),
        ):
            assert request(url, "/api/state", headers={"Authorization": bad})[0] == 401, bad


@pytest.mark.process
def test_it_never_writes(dbs):
    queue, sink = dbs
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in dbs}
    files = set(os.listdir(queue.parent))
    with dashboard(queue, "--sink-db", sink) as url:
        first = state(url)["at_ms"]
        until(lambda: state(url)["at_ms"] > first)  # sampled again since
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in dbs} == before
    assert set(os.listdir(queue.parent)) == files  # no journal, no WAL


@pytest.mark.process
def test_it_follows_the_queue_and_says_when_it_cannot_read(dbs, tmp_path):
    queue, _ = dbs
    with dashboard(queue) as url:
        ok("enqueue", queue, "--id", "f", "--qty", "1")
        until(lambda: state(url)["stats"]["by_status"]["pending"] == 3)
        moved = tmp_path / "moved.db"
        queue.rename(moved)
        shown = until(lambda: (seen := state(url))["error"] and seen)
        assert f"no queue at {queue}" in shown["error"]
        assert shown["stats"]["by_status"]["pending"] == 3  # the last good sample
        assert request(url, "/metrics")[0] == 503
        moved.rename(queue)
        until(lambda: state(url)["error"] is None)
        assert request(url, "/metrics")[0] == 200


def kill_mid_transaction(queue):
    """A writer SIGKILLed inside a transaction that reached the file: a hot journal."""
    code = (
        "import os, signal, sqlite3, sys\n"
        "con = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "con.execute('PRAGMA cache_size=1')\n"  # spill the change to the file
        "con.execute('BEGIN IMMEDIATE')\n"
        "con.execute('UPDATE jobs SET qty = qty + 1')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(queue)], check=False, timeout=30)
    assert run.returncode == -signal.SIGKILL


@pytest.mark.process
def test_a_writer_killed_mid_transaction_is_said_and_outlived(dbs):
    queue, _ = dbs
    ops.enqueue_all(queue, [({"id": f"x-{i}", "qty": 1}, 60_000, 3) for i in range(3000)])
    kill_mid_transaction(queue)
    said = fails("dashboard", queue)
    assert "a writer died mid-transaction" in said and said.count("\n") == 1
    ok("init", queue)  # a writer rolls the journal back
    with dashboard(queue) as url:
        assert state(url)["stats"]["by_status"]["pending"] == 3002
        kill_mid_transaction(queue)
        shown = until(lambda: (seen := state(url))["error"] and seen)
        assert "a writer died mid-transaction" in shown["error"]
        ok("init", queue)
        until(lambda: state(url)["error"] is None)
    with readers.read_only(queue, "jobs") as con:  # no change survived the kills
        assert con.execute("SELECT sum(qty) FROM jobs").fetchone()[0] == 15 + 3000


@pytest.mark.process
def test_refusals_are_one_line_at_start(dbs, tmp_path, capsys):
    queue, sink = dbs
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all" * 100)
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    cases = [
        ((tmp_path / "missing.db",), "no queue at"),
        ((tmp_path,), "no queue at"),
        ((garbage,), "is not a queue DB"),
        ((empty,), "is not a queue DB (no jobs table)"),
        ((queue, "--sink-db", tmp_path / "nosink.db"), "no sink DB at"),
        ((queue, "--sink-db", queue), "is not a sink DB (no stock_moves table)"),
        ((sink,), "is not a queue DB (no jobs table)"),
        ((queue, "--host", "0.0.0.0"), "without --allow-remote"),
        ((queue, "--host", "example.com"), "without --allow-remote"),
        ((queue, "--auth-token", ""), "--auth-token must be"),
        ((queue, "--auth-token", "with space"), "--auth-token must be"),
    ]
    for args, why in cases:  # in this process: the same main() as the command
        assert main(["dashboard", *map(str, args)]) == 1
        said = capsys.readouterr()
        assert said.out == "" and said.err.startswith("asnackq dashboard: ")
        assert why in said.err and said.err.count("\n") == 1, (args, said.err)
    for port in ("-1", "65536", "99999999999999999999", "http"):
        with pytest.raises(SystemExit) as usage:
            main(["dashboard", str(queue), "--port", port])
        assert usage.value.code == 2 and "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as shown:
        main(["dashboard", "--help"])
    assert shown.value.code == 0 and "--sink-db" in capsys.readouterr().out
    assert "no queue at" in fails("dashboard", tmp_path / "missing.db")  # and as a process
    assert not (tmp_path / "missing.db").exists() and not (tmp_path / "nosink.db").exists()


def test_throughput_is_done_per_second_over_the_last_minute(tmp_path):
    watcher = Watcher(tmp_path / "unused.db")
    assert watcher.throughput(1_000_000, 10)["done_per_s"] is None  # one sample: no rate
    assert watcher.throughput(1_002_000, 30)["done_per_s"] == 10.0
    figures = watcher.throughput(1_070_000, 90)  # 70 s after the first
    assert figures["window_s"] == 68.0 and figures["done_per_s"] == round(60 / 68, 1)
    assert figures["series"] == [[0.0, round(60 / 68, 1)]]  # only the last minute
    late = watcher.throughput(1_200_000, 90)
    assert late["window_s"] == 130.0 and late["done_per_s"] == 0.0  # one point before it
