"""The lab's sink counters add up over every sink incarnation, SIGKILLed ones included."""

from __future__ import annotations

import json
import random
import sqlite3
import urllib.request

import pytest

from asnackq.lab.procs import Replicas

from .test_cli import asnackq


def post(url, job_id, qty=1):
    body = json.dumps({"id": job_id, "qty": qty}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["status"]


@pytest.mark.process
def test_replicas_sum_the_counters_of_a_sigkilled_incarnation_and_its_successor(tmp_path):
    with Replicas(tmp_path / "sink.db", 1) as sinks:
        (url,) = sinks.urls
        assert [post(url, f"a-{i}") for i in range(5)] == ["applied"] * 5
        assert post(url, "a-0") == "duplicate"
        sinks.kill_one(random.Random(1))  # read just before the SIGKILL: nothing unseen
        assert [post(url, f"a-{i}") for i in range(3)] == ["duplicate"] * 3
        assert post(url, "b-0") == "applied"
        counts = sinks.counters()
    assert sinks.kills == 1 and sinks.codes == [0]
    assert (counts["requests"], counts["applied"], counts["duplicates"]) == (10, 6, 4)


@pytest.mark.process
@pytest.mark.timeout(220)
def test_the_lab_with_sink_kills_counts_every_incarnation_and_says_how_far(tmp_path):
    out = tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--jobs",
        "400",  # (at least ten seconds of sends: the second kill, a sink's, comes first)
        "--processes",
        "1",
        "--concurrency",
        "4",
        "--delay-ms",
        "100",
        "--kill-every",
        "2.0",
        "--max-attempts",
        "16",
        "--kill-sinks",
        "--lease-ms",
        "1000",
        "--send-timeout-s",
        "0.5",
        "--seed",
        "4",
        "--dir",
        tmp_path / "lab",
        "--json",
        out,
        timeout=200,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["violations"] == [] and result["sink_kills"] >= 1
    assert result["sink_counts_exact"] is False and "at least" in run.stderr + run.stdout
    con = sqlite3.connect(tmp_path / "lab" / "sink.db")
    rows, duplicates = con.execute(
        "SELECT count(*), sum(deliveries - 1) FROM asnackq_webhook_inbox"
    ).fetchone()
    con.close()
    assert rows == 400 and result["duplicates"] == duplicates
    # Every incarnation's requests: all but those a killed sink counted between its last
    # reading and its SIGKILL (and some it counted but never answered, the kill first).
    assert result["requests"] >= (rows + duplicates) * 0.95
