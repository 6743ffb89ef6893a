"""Step 8 with real child processes: races, hard exits inside hooks, a killed deliverer."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from asnackq.core import worker as w
from asnackq.lab.procs import PIPE, start, stop

from .conftest import T0, job

WORKER = str(Path(w.__file__))

# Every child loads worker.py by path, as the grader does.
PRELUDE = f"""
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("worker", {WORKER!r})
w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
"""

RACE = (
    PRELUDE
    + """
db, owner, now = sys.argv[1], sys.argv[2], int(sys.argv[3])
con = w.open_queue(db)
print("ready", flush=True)
sys.stdin.read(1)             # the barrier: both are released by one write each
print(json.dumps(w.claim(con, owner, now)))
"""
)

CRASH = (
    PRELUDE
    + """
db, action, point, now = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def fault(p):
    if p == point:
        os._exit(17)
con = w.open_queue(db)
if action == "claim":
    w.claim(con, "w1", now, 1000, fault)
elif action == "finish":
    w.finish(con, json.loads(sys.argv[5]), "ok", now, 0, fault)
else:
    w.redrive(con, "a", now, 1000, "ops", fault)
"""
)

DELIVERER = (
    PRELUDE
    + """
import urllib.request
db, port, now, owner = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def send(event):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/events", data=json.dumps(event).encode(),
        headers={"Content-Type": "application/json", "X-Pid": str(os.getpid())})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response).get("id") == event["id"]
print(json.dumps(w.run_file(db, owner, lambda: now, send, 1.0, 1000)))
"""
)


def child(script: str, *args: object) -> list[str]:
    return [sys.executable, "-B", "-c", script, *map(str, args)]


@pytest.mark.process
@pytest.mark.parametrize("round_", range(3))
def test_two_processes_released_together_claim_one_job_once(con, db, round_):
    w.enqueue(con, {"id": "a", "qty": 1}, T0, 10_000)
    racers = [start(child(RACE, db, owner, T0), stdin=PIPE, stdout=PIPE) for owner in ("p1", "p2")]
    try:
        assert [p.stdout.readline() for p in racers] == ["ready\n", "ready\n"]  # connected
        for p in racers:
            p.stdin.write("go")
            p.stdin.flush()
        results = [json.loads(p.communicate(timeout=30)[0]) for p in racers]
    finally:
        assert stop(*racers) == [0, 0]
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and winners[0]["token"] == 1
    assert job(db, "a")["owner"] == winners[0]["owner"]


@pytest.mark.parametrize(
    ("point", "status", "token"), [("after-claim", "pending", 0), ("after-commit", "leased", 1)]
)
@pytest.mark.process
def test_exit_inside_a_claim_hook_is_atomic(con, db, point, status, token):
    w.enqueue(con, {"id": "a", "qty": 1}, T0, 10_000)
    w.enqueue(con, {"id": "old", "qty": 1}, T0, 5)  # quarantined by the same transaction
    run = subprocess.run(child(CRASH, db, "claim", point, T0 + 5), timeout=30, check=False)
    assert run.returncode == 17
    again = w.open_queue(db)  # the hot journal, if any, is rolled back here
    try:
        assert (job(db, "a")["status"], job(db, "a")["token"]) == (status, token)
        assert job(db, "old")["status"] == ("pending" if token == 0 else "dead")
    finally:
        again.close()


@pytest.mark.parametrize(
    ("point", "status"), [("after-finish", "leased"), ("after-commit", "done")]
)
@pytest.mark.process
def test_exit_inside_a_finish_hook_is_atomic(con, db, point, status):
    w.enqueue(con, {"id": "a", "qty": 1}, T0, 10_000)
    ticket = w.claim(con, "w1", T0)
    run = subprocess.run(
        child(CRASH, db, "finish", point, T0 + 1, json.dumps(ticket)), timeout=30, check=False
    )
    assert run.returncode == 17
    w.open_queue(db).close()
    assert job(db, "a")["status"] == status


@pytest.mark.parametrize(
    ("point", "status", "audits"),
    [("after-audit", "dead", 0), ("after-redrive", "dead", 0), ("after-commit", "pending", 1)],
)
@pytest.mark.process
def test_exit_inside_a_redrive_hook_is_atomic(con, db, point, status, audits):
    w.enqueue(con, {"id": "a", "qty": 1}, T0, 1)
    w.claim(con, "w1", T0 + 1)
    run = subprocess.run(child(CRASH, db, "redrive", point, T0 + 2), timeout=30, check=False)
    assert run.returncode == 17
    w.open_queue(db).close()
    assert job(db, "a")["status"] == status
    check = sqlite3.connect(db)
    try:
        assert check.execute("SELECT count(*) FROM redrives").fetchone() == (audits,)
    finally:
        check.close()


class KillingSink(ThreadingHTTPServer):
    """A stdlib inbox sink: inbox row + stock in one commit; it can SIGKILL its first caller."""

    def __init__(self, db: Path) -> None:
        super().__init__(("127.0.0.1", 0), SinkHandler)
        self.db = db
        self.requests: list[str] = []
        self.kill_first = True
        con = sqlite3.connect(db)
        con.executescript(
            "CREATE TABLE inbox (id TEXT PRIMARY KEY, qty INTEGER NOT NULL);"
            "CREATE TABLE stock (total INTEGER NOT NULL);"
            "INSERT INTO stock VALUES (0);"
        )
        con.close()


class SinkHandler(BaseHTTPRequestHandler):
    server: KillingSink

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        event = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(event["id"])
        con = sqlite3.connect(self.server.db, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        if con.execute("SELECT 1 FROM inbox WHERE id = ?", (event["id"],)).fetchone() is None:
            con.execute("INSERT INTO inbox VALUES (?, ?)", (event["id"], event["qty"]))
            con.execute("UPDATE stock SET total = total + ?", (event["qty"],))
        con.execute("COMMIT")
        con.close()
        if self.server.kill_first:  # the effect is committed; the ACK never arrives
            self.server.kill_first = False
            os.kill(int(self.headers["X-Pid"]), signal.SIGKILL)
            return
        body = json.dumps({"id": event["id"], "status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.process
def test_a_deliverer_killed_after_the_effect_is_recovered_by_another_process(con, db, tmp_path):
    w.enqueue(con, {"id": "snack-7", "qty": 7}, T0, 30_000)
    sink = KillingSink(tmp_path / "sink.db")
    thread = threading.Thread(target=sink.serve_forever, daemon=True)
    thread.start()
    try:
        port = sink.server_address[1]
        first = subprocess.run(
            child(DELIVERER, db, port, T0, "alpha"), capture_output=True, timeout=30, check=False
        )
        assert first.returncode == -signal.SIGKILL
        assert (job(db, "snack-7")["status"], job(db, "snack-7")["owner"]) == ("leased", "alpha")
        # A second process after the lease expired: it re-sends, the inbox absorbs it.
        second = subprocess.run(
            child(DELIVERER, db, port, T0 + 1000, "beta"),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(second.stdout) == {"id": "snack-7", "token": 2, "status": "done"}
    finally:
        sink.shutdown()
        sink.server_close()
        thread.join(timeout=10)
    assert sink.requests == ["snack-7", "snack-7"]
    check = sqlite3.connect(tmp_path / "sink.db")
    try:
        assert check.execute("SELECT * FROM inbox").fetchall() == [("snack-7", 7)]
        assert check.execute("SELECT total FROM stock").fetchone() == (7,)
    finally:
        check.close()
    assert (job(db, "snack-7")["status"], job(db, "snack-7")["owner"]) == ("done", None)
