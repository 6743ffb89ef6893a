"""The real ``asnackq`` command at its limits: every option out of its range is a usage
error (exit 2), a closed stdin and a full disk are one line that says what was done, and
``work --json`` prints its summary even when the run dies."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess

import pytest

from asnackq.lab import procs
from asnackq.lab.procs import sink_process

from .logs import problems
from .test_cli import asnackq, fails, ok

SINK = "http://127.0.0.1:9/events"


@pytest.fixture
def queue(tmp_path):
    path = tmp_path / "q.db"
    ok("init", path)
    ok("enqueue", path, "--id", "a", "--qty", "1")
    return path


@pytest.mark.parametrize(
    "options",
    [
        ("--concurrency", "0"),
        ("--concurrency", "1025"),
        ("--lease-ms", "0"),
        ("--lease-ms", "3600001"),
        ("--prefetch", "-1"),
        ("--prefetch", "1025"),
        ("--retry-base-ms", "0"),
        ("--retry-base-ms", "500", "--retry-cap-ms", "100"),
        ("--breaker-after", "0"),
        ("--breaker-max-ms", "0"),
        ("--kill-after-acks", "0"),
        ("--timeout-s", "0"),
        ("--timeout-s", "601"),
        ("--owner", "not a name"),
    ],
)
@pytest.mark.process
def test_work_options_out_of_range_are_usage_errors(queue, options):
    before = queue.read_bytes()
    said = fails("work", queue, "--sink", SINK, "--until-empty", *options, code=2)
    assert said.startswith("asnackq work: ")
    assert queue.read_bytes() == before


@pytest.mark.parametrize(
    "options",
    [
        ("--jobs", "0"),
        ("--processes", "0"),
        ("--processes", "65"),
        ("--concurrency", "0"),
        ("--lease-ms", "0"),
        ("--max-attempts", "0"),
        ("--kill-after-acks", "0"),
        ("--kill-after-acks", "5", "--kill-every", "1"),
    ],
)
@pytest.mark.process
def test_lab_options_out_of_range_are_usage_errors(tmp_path, options):
    said = fails("lab", "--dir", tmp_path / "lab", *options, code=2)
    assert said.startswith("asnackq lab: ")
    assert not (tmp_path / "lab").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("enqueue", "--id", "a", "--qty", "0"),
        ("enqueue", "--id", "a b", "--qty", "1"),
        ("enqueue", "--id", "a", "--qty", "1", "--ttl-ms", "0"),
        ("enqueue", "-", "--max-attempts", "17"),
        ("redrive", "a", "--ttl-ms", "0", "--note", "n"),
        ("redrive", "--reason", "exhausted", "--ttl-ms", "1", "--note", "two words"),
    ],
)
@pytest.mark.process
def test_queue_options_out_of_range_are_usage_errors(queue, args):
    before = queue.read_bytes()
    fails(args[0], queue, *args[1:], code=2, stdin="")
    assert queue.read_bytes() == before


@pytest.mark.process
def test_a_remote_sink_is_refused_naming_the_option(queue, tmp_path):
    remote = "http://192.0.2.1:80/events"  # TEST-NET-1: never contacted
    said = fails("work", queue, "--sink", remote, code=2)
    assert "without --allow-remote" in said and "allow_remote=True" not in said
    source = tmp_path / "source.db"
    ok("outbox", "accept", source, "--id", "o1", "--qty", "1")
    said = fails("outbox", "dispatch", source, "--sink", remote, code=2)
    assert "without --allow-remote" in said and "allow_remote=True" not in said


@pytest.mark.process
def test_enqueue_from_a_closed_stdin_is_one_line(queue):
    before = queue.read_bytes()
    run = subprocess.run(
        procs.command("enqueue", queue, "-"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        preexec_fn=lambda: os.close(0),  # <&-
    )
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("asnackq enqueue: stdin is closed")
    assert queue.read_bytes() == before


@contextlib.contextmanager
def small_disk(where, size):
    """A tmpfs of ``size`` mounted at ``where`` (root only), unmounted at the end."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr!r}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def count(path):
    con = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        return con.execute("SELECT count(*) FROM jobs").fetchone()[0]
    finally:
        con.close()


@pytest.mark.process
def test_enqueue_stopped_by_a_full_disk_says_what_it_committed_and_where_to_resume(tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    records = (json.dumps({"id": f"job-{i}", "qty": 1}) for i in range(30_000))
    jobs.write_text("\n\n" + "\n".join(records) + "\n")
    with small_disk(tmp_path / "disk", "1m") as disk:
        queue = disk / "q.db"
        ok("init", queue)
        said = fails("enqueue", queue, jobs)
        committed = count(queue)
    assert 0 < committed < 30_000
    assert said.startswith("asnackq enqueue: database or disk is full: ")
    assert f"stopped after {committed} of 30000 jobs were committed ({committed} inserted)" in said
    assert f"the rest begins at {jobs} line {committed + 3} " in said  # two blank lines


def fill(path):
    """Write to ``path`` until the disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


@pytest.mark.process
def test_work_prints_its_summary_when_a_full_disk_ends_the_run(tmp_path):
    with small_disk(tmp_path / "disk", "512k") as disk, sink_process(tmp_path / "s.db") as url:
        queue = disk / "q.db"
        ok("init", queue)
        ok("enqueue", queue, "--id", "a", "--qty", "1")
        fill(disk / "filler")
        run = asnackq("work", queue, "--sink", url, "--until-empty", "--json")
    assert run.returncode == 1, run.stderr
    assert problems(run.stderr) == "asnackq work: database or disk is full\n"
    summary = json.loads(run.stdout)
    assert summary["error"] == "database or disk is full" and summary["done"] == 0
