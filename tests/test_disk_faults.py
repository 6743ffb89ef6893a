"""SQLite files on a full disk or a read-only filesystem: ``work``, ``enqueue`` and the sink.

The disk is a tiny tmpfs mounted for the test (root only; skipped otherwise), filled with
a file and freed by deleting it.  ``work`` and ``enqueue`` end with one line and exit 1,
never a traceback, and leave the file whole; the sink answers 503 while its inbox cannot
commit and applies again once it can.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from asnackq.lab.procs import PIPE, command, sink_process, sink_stats, worker

from .logs import problems

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mount], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", mount], check=True)


def fill(disk: Path) -> Path:
    """Fill the disk to the last block; delete the returned file to free it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def run(*args: object, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(*args), input=stdin, capture_output=True, text=True, timeout=60)


def read(path: Path, sql: str) -> list[tuple[object, ...]]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def whole(path: Path) -> bool:
    return read(path, "PRAGMA integrity_check") == [("ok",)]


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    stderr = problems(stderr)  # (a worker's started and stopped lines aside)
    assert len(stderr.strip().splitlines()) == 1, stderr
    return stderr.strip()


def queue_with(path: Path, jobs: int) -> dict[str, int]:
    qty = {f"j{i}": i % 5 + 1 for i in range(jobs)}
    assert run("init", path).returncode == 0
    lines = "".join(json.dumps({"id": i, "qty": q}) + "\n" for i, q in qty.items())
    assert run("enqueue", path, "-", stdin=lines).returncode == 0
    return qty


def post(url: str, event_id: str) -> tuple[int, dict[str, str]]:
    body = json.dumps({"id": event_id, "qty": 1}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.load(error)


@pytest.mark.process
def test_the_sink_answers_503_while_its_disk_is_full_and_recovers(disk):
    with sink_process(disk / "sink.db") as url:
        assert post(url, "a") == (200, {"id": "a", "status": "applied"})
        filler = fill(disk)
        assert post(url, "b") == (503, {"id": "b", "status": "unavailable"})
        assert post(url, "c")[0] == 503
        assert sink_stats(url)["stock"] == 1  # reads go on
        filler.unlink()
        assert post(url, "b") == (200, {"id": "b", "status": "applied"})
        assert post(url, "a") == (200, {"id": "a", "status": "duplicate"})
        stats = sink_stats(url)
    assert (stats["stock"], stats["applied"], stats["failed"]) == (2, 2, 2)
    assert whole(disk / "sink.db")
    applied = read(disk / "sink.db", "SELECT id FROM asnackq_webhook_inbox ORDER BY id")
    assert applied == [("a",), ("b",)]


@pytest.mark.process
def test_work_stops_with_one_line_when_the_disk_fills_and_finishes_once_freed(disk, tmp_path):
    queue = disk / "queue.db"
    qty = queue_with(queue, 300)
    with sink_process(tmp_path / "sink.db", "--delay-ms", "20") as url:
        work = worker(queue, url, "--until-empty", "--concurrency", "2", stdout=PIPE, stderr=PIPE)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not read(
                queue, "SELECT 1 FROM jobs WHERE status = 'done' LIMIT 1"
            ):
                time.sleep(0.02)
            filler = fill(disk)  # mid-run: the next commit finds no room
            _, err = work.communicate(timeout=60)
        finally:
            work.kill()
            work.wait()
        assert work.returncode == 1
        assert "full" in one_line(err)
        assert whole(queue)
        filler.unlink()
        again = run("work", queue, "--sink", url, "--until-empty", "--json")
        assert again.returncode == 0, again.stderr
    assert read(queue, "SELECT status, count(*) FROM jobs GROUP BY 1") == [("done", 300)]
    inbox = read(tmp_path / "sink.db", "SELECT id, qty FROM stock_moves")
    assert dict(inbox) == qty  # each effect once


@pytest.mark.process
def test_enqueue_on_a_full_disk_is_one_line_and_exit_1(disk):
    queue = disk / "queue.db"
    queue_with(queue, 10)
    filler = fill(disk)
    lines = "".join(json.dumps({"id": f"n{i}", "qty": 1}) + "\n" for i in range(500))
    made = run("enqueue", queue, "-", stdin=lines)
    assert made.returncode == 1
    assert "full" in one_line(made.stderr)
    assert whole(queue)
    filler.unlink()
    assert run("enqueue", queue, "-", stdin=lines).returncode == 0
    assert read(queue, "SELECT count(*) FROM jobs") == [(510,)]


@pytest.mark.process
def test_work_and_enqueue_on_a_read_only_file_are_one_line_and_exit_1(disk, tmp_path):
    queue = disk / "queue.db"
    queue_with(queue, 5)
    before = hashlib.sha256(queue.read_bytes()).hexdigest()
    subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
    with sink_process(tmp_path / "sink.db") as url:
        work = run("work", queue, "--sink", url, "--until-empty")
    intake = run("enqueue", queue, "--id", "x", "--qty", "1")
    for done in (work, intake):
        assert done.returncode == 1
        assert "readonly" in one_line(done.stderr)
    assert hashlib.sha256(queue.read_bytes()).hexdigest() == before
