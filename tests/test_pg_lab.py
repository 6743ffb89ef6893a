"""The lab on PostgreSQL: K sink replicas on one inbox, SIGKILLs of workers and of sinks."""

from __future__ import annotations

import json

import pytest

from .pgdb import query
from .test_cli import asnackq, fails


@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
def test_lab_with_replicas_and_kills_of_workers_and_sinks_finds_no_violation(pg_db, tmp_path):
    url, out = pg_db(), tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--db",
        url,
        "--sinks",
        "2",
        "--jobs",
        "600",
        "--processes",
        "2",
        "--concurrency",
        "16",
        "--fail-rate",
        "0.05",
        "--drop-rate",
        "0.05",
        "--kill-every",
        "0.3",
        "--rate",  # (600 jobs take 1.5 s at least: kills of both kinds, however fast it runs)
        "400",
        "--kill-sinks",
        "--seed",
        "11",
        "--lease-ms",
        "1500",
        "--send-timeout-s",
        "0.5",
        "--dir",
        tmp_path / "lab",
        "--json",
        out,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["violations"] == [] and result["liveness_failures"] == []
    assert result["statuses"] == {"done": 600} and result["sinks"] == 2
    # The kills alternate, a worker first (how many there are depends on the run's length).
    total = result["kills"] + result["sink_kills"]
    assert total >= 2 and result["sink_kills"] == total // 2
    assert query(url, "SELECT count(*), sum(qty) FROM stock_moves") == [
        (600, query(url, "SELECT total FROM stock")[0][0])
    ]
    assert "must hold no jobs" in fails("lab", "--db", url, "--jobs", "10")  # used: refused


@pytest.mark.process
@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
def test_lab_on_a_throwaway_local_server(tmp_path):
    out = tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--pg-local",
        "--jobs",
        "100",
        "--processes",
        "1",
        "--concurrency",
        "8",
        "--json",
        out,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["violations"] == [] and result["statuses"] == {"done": 100}
    assert result["config"]["db"].startswith("postgresql://")


@pytest.mark.process
def test_lab_refuses_replicas_without_postgresql():
    assert "give --db or --pg-local" in fails("lab", "--sinks", "2", code=2)
    stderr = fails("lab", "--db", "postgresql:me:hunter2@typo", code=2)
    assert "not a PostgreSQL URL" in stderr and "hunter2" not in stderr
