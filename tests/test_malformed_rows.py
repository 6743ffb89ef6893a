"""A job row holding values of other types than the schema's (SQLite lets a hand-written
row put text or a blob in an INTEGER column): ``audit`` names it a violation, ``stats`` and
the dashboard show what they can, and the dashboard's sampler outlives such a row appearing
while it runs.  Never a traceback."""

from __future__ import annotations

import json
import sqlite3
import subprocess

import pytest

from asnackq.lab import procs

from . import test_dashboard
from .test_dashboard import dashboard, request, state, until

dbs = test_dashboard.dbs  # a queue with a job in every state, and a sink DB
pytestmark = pytest.mark.process

BAD = """INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,
  deadline, owner, lease_until, reason)
VALUES ('bad', 'x', 'leased', 1.5, 3, 'tok', 0, 'never', 'w', X'00', NULL)"""


def add_bad_row(queue):
    con = sqlite3.connect(queue)
    with con:
        con.execute(BAD)
    con.close()


def asnackq(*args):
    done = subprocess.run(procs.command(*args), capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_audit_names_a_wrongly_typed_row_a_violation(dbs):
    queue, sink = dbs
    add_bad_row(queue)
    text = asnackq("audit", queue, "--sink-db", sink)
    assert text.returncode == 1 and "wrong-type" in text.stdout, text.stdout
    as_json = asnackq("audit", queue, "--sink-db", sink, "--json")
    audit = json.loads(as_json.stdout)
    assert audit["flags"]["wrong-type"] == 1 and audit["stages"]["malformed"] == 1
    (bad,) = [v for v in audit["listed"]["violations"] if v["id"] == "bad"]
    assert bad["job"]["lease_until"] == "x'00'" and bad["job"]["token"] == "tok"
    one = asnackq("audit", queue, "--sink-db", sink, "--id", "bad")
    assert one.returncode == 1 and "wrong-type" in one.stdout
    assert asnackq("stats", queue, "--json").returncode == 0


def test_the_dashboard_starts_shows_what_it_can_and_outlives_a_bad_row(dbs):
    queue, sink = dbs
    with dashboard(queue, "--sink-db", sink) as url:
        first = until(lambda: (seen := state(url))["audit"] and seen)
        assert first["audit"]["flags"]["wrong-type"] == 0
        add_bad_row(queue)  # while it runs

        def flagged():
            seen = state(url)
            return seen["audit"]["flags"]["wrong-type"] == 1 and seen

        later = until(flagged, timeout=60)
        held = [o for o in later["leases"] if o["owner"] == "w"]
        assert held[0]["jobs"] == [{"id": "bad", "token": "tok", "left_ms": None}]
        status, _, body = request(url, "/api/jobs/bad")
        assert status == 503 and "another type" in json.loads(body)["error"], body
        # The sampler goes on: its readings move on after the bad row came.
        until(lambda: state(url)["at_ms"] > later["at_ms"], timeout=30)
    with dashboard(queue, "--sink-db", sink) as url:  # and it starts with the row there
        assert until(lambda: (seen := state(url))["audit"] and seen)["audit"]["violations"] >= 1
