"""The lab's hosts (network namespaces) and its faults on a schedule, with real processes.

Namespaces need root on Linux: elsewhere these tests skip (CI and the project's machine
run them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from asnackq.cli import main
from asnackq.lab import hosts
from asnackq.lab.procs import command, kill, sink_process, start

from .test_cli import asnackq

ROOT = sys.platform.startswith("linux") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="network namespaces need root on Linux")


def namespaces(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [n.split()[0] for n in listed.stdout.splitlines() if f"asnackq-{pid}-" in n]


def links(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return [line for line in listed.stdout.splitlines() if f" aq{pid}x" in line]


def reaches(made: hosts.Hosts, host: int, addr: str, port: int) -> bool:
    """Whether a process on ``host`` connects to ``addr:port`` within a second."""
    code = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=1)"
    done = subprocess.run([*made.argv(host), sys.executable, "-c", code], capture_output=True)
    return done.returncode == 0


@pytest.mark.process
@needs_root
def test_hosts_reach_the_root_namespace_on_their_link_and_a_partition_cuts_one_side():
    with (
        hosts.Hosts(2) as made,
        socket.socket() as db,
        socket.socket() as sink,
    ):
        db.bind((made.db_addr, 0))
        sink.bind((made.sink_addr, 0))
        db.listen()
        sink.listen()
        assert sorted(namespaces(os.getpid())) == [made.namespace(0), made.namespace(1)]
        ports = {made.db_addr: db.getsockname()[1], made.sink_addr: sink.getsockname()[1]}
        assert all(reaches(made, 0, a, p) for a, p in ports.items())
        made.partition(0, "sinks")
        assert reaches(made, 0, made.db_addr, ports[made.db_addr])
        assert not reaches(made, 0, made.sink_addr, ports[made.sink_addr])
        assert reaches(made, 1, made.sink_addr, ports[made.sink_addr])  # the others go on
        made.heal(0)
        assert reaches(made, 0, made.sink_addr, ports[made.sink_addr])
        # nothing outside the machine: a host has no route but its link
        assert not reaches(made, 1, "192.0.2.1", 9)
    assert namespaces(os.getpid()) == [] and links(os.getpid()) == []


@pytest.mark.process
@needs_root
def test_a_dead_labs_leftovers_are_swept_at_the_next_start():
    gone = start([sys.executable, "-c", "pass"])
    gone.wait()
    stale = hosts.Hosts(1, pid=gone.pid)
    stale.__enter__()  # never closed: as if SIGKILLed
    assert namespaces(gone.pid) and links(gone.pid)
    with hosts.Hosts(1):
        assert namespaces(gone.pid) == [] and links(gone.pid) == []


def test_hosts_without_root_is_one_line_and_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["lab", "--hosts", "2", "--pg-local"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "asnackq lab: --hosts needs root (it makes network namespaces)"


@pytest.mark.process
@needs_root
def test_fault_options_refused_without_what_they_need():
    for args, why in (
        (["--hosts", "2"], "--hosts needs --pg-local"),
        (["--pg-restart-every", "1"], "--pg-restart-every needs --pg-local"),
        (["--pg-kill-backends-every", "1"], "needs --db or --pg-local"),
        (["--pg-local", "--hosts", "1", "--partition-every", "1"], "go together"),
        (["--pg-local", "--partition-every", "1", "--partition-for", "1"], "needs --hosts"),
    ):
        run = asnackq("lab", *args)  # options that do not fit together: a usage error
        assert run.returncode == 2 and why in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.process
@needs_root
def test_a_sigtermed_lab_removes_its_namespaces_and_links(tmp_path):
    lab = start(
        command("lab", "--pg-local", "--hosts", "2", "--jobs", "100000", "--dir", tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.trace")) and time.monotonic() < deadline:
            time.sleep(0.1)  # the workers run on the hosts
        assert len(namespaces(lab.pid)) == 2
        lab.send_signal(signal.SIGTERM)
        lab.wait(timeout=60)
    finally:
        if lab.poll() is None:
            kill(lab)
    assert namespaces(lab.pid) == [] and links(lab.pid) == []


def lab_with(tmp_path, *faults, jobs=400):
    """A short lab on a throwaway server and 2 hosts with ``faults``; its result.

    The sinks answer after 50 ms and 8 sends are in flight: at most 160 jobs a second,
    however fast the machine, so the run outlasts the first scheduled fault."""
    out = tmp_path / "lab.json"
    run = asnackq(
        "lab",
        "--pg-local",
        "--sinks",
        "2",
        "--jobs",
        str(jobs),
        "--processes",
        "2",
        "--concurrency",
        "4",
        "--delay-ms",
        "50",
        "--lease-ms",
        "1500",
        "--send-timeout-s",
        "0.5",
        "--max-attempts",
        "16",
        *faults,
        "--json",
        out,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["violations"] == [] and result["liveness_failures"] == []
    assert result["statuses"] == {"done": jobs}
    return result


def of_kind(result, kind):
    faults = [f for f in result["faults"] if f["kind"] == kind]
    assert faults and result["faults_by_kind"][kind]["count"] == len(faults)
    assert {f["kind"] for f in result["series"]["faults"]} == {kind}
    assert sum(f["duplicates"] for f in faults) <= result["duplicates"]
    return faults


@pytest.mark.process
@needs_root
@pytest.mark.timeout(300)
def test_lab_partitions_hosts_and_every_job_ends_done(tmp_path):
    result = lab_with(
        tmp_path, "--hosts", "2", "--partition-every", "2", "--partition-for", "1", jobs=600
    )
    partitions = of_kind(result, "partition")
    assert all(f["until"] - f["at"] >= 1000 for f in partitions[:-1])  # the last: at the end
    assert {f["detail"].split(" from ")[1] for f in partitions} <= {"db", "sinks", "both"}


@pytest.mark.process
@pytest.mark.timeout(300)
def test_lab_restarts_the_server_fast_and_immediate_and_every_job_ends_done(tmp_path):
    restarts = of_kind(lab_with(tmp_path, "--pg-restart-every", "1"), "pg-restart")
    assert [f["detail"] for f in restarts[:2]] == ["fast", "immediate"][: len(restarts)]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_lab_kills_the_backends_and_every_job_ends_done(tmp_path):
    kills = of_kind(lab_with(tmp_path, "--pg-kill-backends-every", "0.5"), "pg-kill-backends")
    assert max(int(f["detail"].split()[0]) for f in kills) >= 2  # workers' and sinks'


@pytest.mark.process
@needs_root
@pytest.mark.timeout(300)
def test_lab_skews_each_hosts_clock_and_every_job_ends_done(tmp_path):
    result = lab_with(tmp_path, "--hosts", "2", "--clock-skew-ms", "300")
    assert result["config"]["clock_skew_ms"] == 300 and result["faults"] == []


@pytest.mark.process
def test_work_reads_the_clock_offset_it_is_given(tmp_path):
    queue, trace = tmp_path / "q.db", tmp_path / "trace"
    assert main(["init", str(queue)]) == 0
    assert main(["enqueue", str(queue), "--id", "a", "--qty", "1", "--ttl-ms", "7200000"]) == 0
    before = time.time() * 1000
    with sink_process(tmp_path / "sink.db") as url:
        run = asnackq(
            "work",
            queue,
            "--sink",
            url,
            "--until-empty",
            "--clock-offset-ms",
            "3600000",
            "--trace",
            trace,
        )
    assert run.returncode == 0, run.stderr
    claim, finish = (json.loads(line) for line in trace.read_text().splitlines())
    assert claim["e"] == "claim" and claim["at"] - before >= 3_600_000
    assert finish["status"] == "done"
