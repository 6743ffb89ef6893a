"""Pacing with real processes: a capacity-limited ``asnackq sink``, ``work --concurrency
auto`` against it, and the lab's options for both."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from asnackq.dispatch.traces import read_traces
from asnackq.lab import LabConfig, run_lab
from asnackq.lab.figures import figures
from asnackq.lab.procs import sink_process, sink_stats

from .conftest import rows
from .test_cli import asnackq, fails, ok


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--max-inflight", "0"),
        ("--max-inflight", "2.5"),
        ("--max-rate", "0"),
        ("--max-rate", "fast"),
        ("--max-rate", "nan"),
    ],
)
@pytest.mark.process
def test_a_sink_capacity_out_of_range_is_one_usage_line(tmp_path, option, value):
    stderr = fails("sink", "--db", tmp_path / "s.db", option, value, code=2)
    assert option in stderr
    assert not (tmp_path / "s.db").exists()


@pytest.mark.process
@pytest.mark.parametrize("value", ["0", "many", "1025"])
def test_work_concurrency_is_auto_or_an_int_in_range(tmp_path, value):
    queue = tmp_path / "q.db"
    ok("init", queue)
    url = "http://127.0.0.1:9/events"
    fails("work", queue, "--sink", url, "--concurrency", value, "--until-empty", code=2)


@pytest.mark.process
def test_work_auto_against_a_capacity_limited_sink_process(tmp_path):
    queue = tmp_path / "q.db"
    ok("init", queue)
    events = "".join(json.dumps({"id": f"e{i}", "qty": 1}) + "\n" for i in range(300))
    ok("enqueue", queue, "-", stdin=events)
    with sink_process(tmp_path / "s.db", "--max-inflight", "3", "--delay-ms", "10") as url:
        run = asnackq(
            "work",
            queue,
            "--sink",
            url,
            "--concurrency",
            "auto",
            "--max-concurrency",
            "32",
            "--until-empty",
            "--json",
            "--trace",
            tmp_path / "w.trace",
            timeout=90,
        )
        stats = sink_stats(url)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["done"], summary["dead"], summary["retried"]) == (300, 0, 0)
    assert summary["overloaded"] == stats["overloaded"]  # every 429 came back to be counted
    assert summary["overloaded"] < 0.1 * summary["requests"]
    assert 1 <= summary["concurrency"] <= 32
    assert stats["inflight_peak"] <= 3 and stats["applied"] == 300
    assert {(r[3], r[4]) for r in rows(queue) if len(r) > 3} == {("done", 1)}


@pytest.mark.process
def test_the_lab_runs_auto_workers_against_a_capacity_limited_sink(tmp_path):
    config = LabConfig(
        jobs=400,
        processes=2,
        concurrency="auto",
        delay_ms=10,
        sink_max_inflight=4,
        lease_ms=3000,
        timeout_s=120,
        directory=tmp_path / "lab",
    )
    result = run_lab(config, Console(stderr=True, quiet=True))
    assert not result.failed, (result.evidence.violations, result.liveness_failures)
    assert result.evidence.statuses == {"done": 400}
    assert result.sink_overloaded == result.series["sink"]["overloaded"][-1]
    assert max(result.series["sink"]["inflight"]) <= 4
    assert result.series["limits"]["limit"], "the workers traced their limits"
    assert any(r["e"] == "limit" for r in read_traces(tmp_path / "lab"))
    assert config.concurrency == result.config["concurrency"] == "auto"
    pacing = {trace["name"]: trace for trace in figures(result)["pacing"]["data"]}
    limits, sink = result.series["limits"], result.series["sink"]
    assert pacing["workers' concurrency limit (sum)"]["y"] == limits["limit"]
    assert pacing["sink: requests in flight"]["x"] == sink["t_s"]
    assert pacing["sink: requests in flight"]["y"] == sink["inflight"]
