"""Receivers slower than a lease, with the defaults, as real processes: ``asnackq sink
--delay-ms`` answering in 4, 10 and 14 s gets every job done once; one answering after the
sender's timeout is told as *timing out*, one not there as *away*, on a worker whose stderr
is a file (one line per state change, text or JSON)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from asnackq.lab import procs
from asnackq.lab.procs import Replicas

from .conftest import execute
from .sinks import dead_port, sink_state

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def run(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        procs.command(*args), capture_output=True, text=True, timeout=timeout, check=False
    )


def enqueue(queue: Path, count: int) -> None:
    assert run("init", queue).returncode == 0
    jobs = "".join(json.dumps({"id": f"o{i}", "qty": 1}) + "\n" for i in range(count))
    entered = subprocess.run(
        procs.command("enqueue", queue, "-"), input=jobs, text=True, capture_output=True
    )
    assert entered.returncode == 0, entered.stderr


@pytest.mark.parametrize("delay_s", [4, 10, 14])
def test_a_receiver_slower_than_the_lease_gets_every_job_done_once(tmp_path, delay_s):
    queue = tmp_path / "q.db"
    enqueue(queue, 6)
    log = tmp_path / "work.log"
    with (
        Replicas(tmp_path / "sink.db", 1, "--delay-ms", delay_s * 1000) as sinks,
        log.open("w") as stderr,
    ):
        work = subprocess.run(
            procs.command("work", queue, "--sink", sinks.urls[0], "--until-empty", "--json"),
            stderr=stderr,
            stdout=subprocess.PIPE,
            text=True,
            timeout=240,
            check=False,
        )
    assert work.returncode == 0, log.read_text()
    summary = json.loads(work.stdout)
    assert summary["done"] == 6 and summary["requests"] == 6  # one request each
    assert summary["timeouts"] == summary["away"] == summary["lost"] == 0
    assert summary["extended"] > 0  # its leases (5 s) were kept across the wait
    tokens = execute(queue, "SELECT status, token, attempts FROM jobs")
    assert tokens == [("done", 1, 1)] * 6
    stock, inbox = sink_state(tmp_path / "sink.db")
    assert stock == 6 and [row[2] for row in inbox] == [1] * 6  # each applied once
    lines = log.read_text().splitlines()
    assert lines[0].startswith("asnackq work: started ") and "timeout_s=15.0" in lines[0]
    assert lines[-1].startswith("asnackq work: stopped ") and "done=6" in lines[-1]


def watch_until(proc: subprocess.Popen[str], log: Path, text: str, within_s: float) -> str:
    """The log's content once it holds ``text`` (the process still running)."""
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        content = log.read_text()
        if text in content:
            return content
        assert proc.poll() is None, content
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {within_s} s: {log.read_text()}")


def test_a_receiver_slower_than_the_timeout_is_timing_out_in_the_log(tmp_path):
    queue = tmp_path / "q.db"
    enqueue(queue, 3)
    log = tmp_path / "work.jsonl"
    with (
        Replicas(tmp_path / "sink.db", 1, "--delay-ms", 3000) as sinks,
        log.open("w") as stderr,
    ):
        command = ("work", queue, "--sink", sinks.urls[0], "--timeout-s", "0.5", "--json")
        proc = subprocess.Popen(
            procs.command(*command, "--log-format", "json", "--breaker-after", "2"),
            stderr=stderr,
            stdout=subprocess.PIPE,
            text=True,
        )
        watch_until(proc, log, '"event": "paused"', 120)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = [record["event"] for record in records]
    assert events[0] == "started" and events[-1] == "stopped" and "stopping" in events
    paused = records[events.index("paused")]
    assert paused["cause"] == "timing_out" and paused["level"] == "warning"
    assert paused["time"].endswith("+00:00") and paused["logger"] == "asnackq.worker"
    summary = json.loads(out)
    assert summary["timeouts"] >= 2 and summary["away"] == 0 and summary["done"] == 0


def test_a_receiver_not_there_is_away_in_the_log(tmp_path):
    queue = tmp_path / "q.db"
    enqueue(queue, 2)
    log = tmp_path / "work.log"
    url = f"http://127.0.0.1:{dead_port()}/events"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            procs.command("work", queue, "--sink", url, "--json", "--breaker-after", "2"),
            stderr=stderr,
            stdout=subprocess.PIPE,
            text=True,
        )
        content = watch_until(proc, log, "paused", 120)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "asnackq work: paused: the sink is away" in content and "cause=away" in content
    summary = json.loads(out)
    assert summary["away"] >= 2 and summary["timeouts"] == 0
