"""A queue file another program holds: the commands wait their turn and say so.

The holder is another process (``hold``): a reader's open transaction, which keeps a
writer's COMMIT waiting, or an exclusive lock, which keeps everyone out.  Each test moves
on when a process says what it is doing (the holder that it holds, a command that it
waits), never after a guessed sleep.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE

import pytest

from asnackq.core import worker as w
from asnackq.lab import procs
from asnackq.lab.procs import sink_process, sink_stats
from asnackq.store.sessions import BUSY_WAIT_S

from .logs import problems

HOLDER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
if sys.argv[2] == "read":
    con.execute("BEGIN")
    con.execute("SELECT count(*) FROM jobs").fetchall()
else:
    con.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
sys.stdin.readline()
con.execute("COMMIT")
print("released", flush=True)
"""
pytestmark = pytest.mark.process


@contextlib.contextmanager
def hold(path: Path, how: str) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``path`` (``read``: a transaction that has read; ``exclusive``:
    the lock) until ``release`` is called on it, or the block ends."""
    argv = [sys.executable, "-c", HOLDER, str(path), how]
    with subprocess.Popen(argv, stdin=PIPE, stdout=PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            yield holder
        finally:
            release(holder)
            holder.wait(timeout=60)


def release(holder: subprocess.Popen[str]) -> None:
    """Let the holder commit and end (once)."""
    if holder.poll() is None and holder.stdin is not None and not holder.stdin.closed:
        holder.stdin.write("go\n")
        holder.stdin.close()


def waits(proc: subprocess.Popen[str], what: str) -> str:
    """Read ``proc``'s stderr until a line holding ``what`` (returned); fails at EOF."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if what in line:
            return line
    raise AssertionError(f"no line with {what!r} before the end of stderr")


def jobs(path: Path) -> dict[str, str]:
    con = sqlite3.connect(path)
    try:
        return dict(con.execute("SELECT id, status FROM jobs"))
    finally:
        con.close()


@pytest.fixture
def queue(tmp_path: Path) -> Path:
    path = tmp_path / "queue.db"
    w.open_queue(path).close()
    return path


@pytest.mark.parametrize("how", ["read", "exclusive"])
def test_enqueue_waits_its_turn_says_so_once_and_inserts(queue, how):
    """``enqueue`` facing a reader's transaction or an exclusive lock waits (one line
    saying so, with its bound) and inserts once the file is free: exit 0, nothing lost."""
    with hold(queue, how) as holder:
        enqueue = procs.start(
            procs.command("enqueue", queue, "--id", "a-1", "--qty", "2"), stdout=PIPE, stderr=PIPE
        )
        line = waits(enqueue, "waiting")
        assert f"{queue} is held by another program" in line and f"{BUSY_WAIT_S:g} s" in line
        release(holder)
        out, err = enqueue.communicate(timeout=120)
    assert enqueue.returncode == 0, err
    assert "inserted 1" in out and not problems(err)
    assert jobs(queue) == {"a-1": "pending"}


@pytest.mark.timeout(300)  # (a bound waited out in a CLI process: on a busy machine, more)
def test_a_writer_gives_up_after_its_bound_in_one_line_and_writes_nothing(queue, tmp_path):
    """A lock held past the bound: the command ends with exit 1 and one more line naming
    the file and the bound; the file is unchanged."""
    before = queue.read_bytes()
    with hold(queue, "exclusive"):
        done = subprocess.run(
            procs.command("enqueue", queue, "--id", "a-1", "--qty", "2"),
            capture_output=True,
            text=True,
            timeout=BUSY_WAIT_S * 4,
        )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "waiting" in lines[0] and "Traceback" not in done.stderr
    assert f"stayed held by another program for {BUSY_WAIT_S:g} s" in lines[1]
    assert queue.read_bytes() == before


def test_work_waits_out_a_reader_and_a_lock_mid_run_and_every_job_is_done_once(queue, tmp_path):
    """A worker delivering to a slow sink meets a reader's transaction, then an exclusive
    lock: it says the queue's database is away and back, keeps no stale lease, and every
    job is done once (the sink applied each once)."""
    count = 400  # (at 4 x 100 ms a send: 10 s of work, far longer than the two holds)
    items = [({"id": f"j-{i}", "qty": 1}, 3_600_000, 5) for i in range(count)]
    con = w.open_queue(queue)
    w.drive(con, w.plan_enqueue_many(items, w.epoch_ms(), limits=w.PRODUCT))
    con.close()
    with sink_process(tmp_path / "sink.db", "--delay-ms", 100) as url:
        work = procs.start(
            procs.command(
                "work", queue, "--sink", url, "--until-empty", "--concurrency", 4, "--json"
            ),
            stdout=PIPE,
            stderr=PIPE,
        )
        try:
            waits(work, "started")
            for how in ("read", "exclusive"):
                with hold(queue, how) as holder:
                    waits(work, "the queue's database is away")
                    release(holder)
                waits(work, "the queue's database is back")
            out, err = work.communicate(timeout=240)
        finally:
            procs.stop(work)
        applied = sink_stats(url)["applied"]
    assert work.returncode == 0, err
    summary = json.loads(out)
    assert summary["done"] == count and summary["db_outages"] >= 2, summary
    assert set(jobs(queue).values()) == {"done"} and applied == count


def test_commands_at_once_on_one_file_all_take_their_turn(queue, tmp_path):
    """Eight ``enqueue``, two ``work``, two ``init`` and three ``stats`` started at once on
    one file: every one exits 0 (none fails for SQLite's one-second busy timeout), and
    every job is done."""
    with sink_process(tmp_path / "sink.db") as url:
        started = []
        for i in range(8):
            lines = tmp_path / f"jobs-{i}.jsonl"
            lines.write_text(
                "".join(json.dumps({"id": f"e{i}-{k}", "qty": 1}) + "\n" for k in range(200))
            )
            started.append(procs.command("enqueue", queue, lines))
        started += [procs.command("work", queue, "--sink", url)] * 2  # (they follow)
        started += [procs.command("init", queue)] * 2 + [procs.command("stats", queue)] * 3
        running = [procs.start(argv, stdout=PIPE, stderr=PIPE) for argv in started]
        workers = [proc for argv, proc in zip(started, running, strict=True) if "work" in argv]
        others = [proc for proc in running if proc not in workers]
        try:
            ended = [(proc.args, proc.communicate(timeout=240), proc.returncode) for proc in others]
            assert all(code == 0 for _, _, code in ended), [e for e in ended if e[2]]
            until_done(queue, 1600)
        finally:
            for proc in workers:
                procs.stop(proc)
    assert all(proc.returncode == 0 for proc in workers), [p.stderr for p in workers]


def until_done(queue: Path, count: int, within_s: float = 240) -> None:
    """Wait (bounded far above the need) until ``count`` jobs are done."""
    gives_up = time.monotonic() + within_s
    while time.monotonic() < gives_up:
        with contextlib.suppress(sqlite3.OperationalError):  # (held by a writer right now)
            if list(jobs(queue).values()).count("done") == count:
                return
        time.sleep(0.1)
    raise AssertionError(f"not every one of {count} jobs done in {within_s} s: {jobs(queue)}")
