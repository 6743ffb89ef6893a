"""Bad arguments to the real ``asnackq`` command: exit 2 for usage, 1 for a failure, one
line on stderr, no traceback, and every file as it was (or never created)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import socket
import sqlite3
import subprocess
import time

import pytest

from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.lab import procs
from asnackq.lab.procs import PIPE, sink_process, stop, worker

from .test_cli import fails, ok


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def queue(tmp_path):
    """A queue holding one pending job."""
    path = tmp_path / "q.db"
    con = w.open_queue(path)
    try:
        w.enqueue(con, {"id": "a", "qty": 1}, epoch_ms(), 60_000)
    finally:
        con.close()
    return path


@pytest.mark.process
@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/events", "http://127.0.0.1:abc/events"])
def test_work_refuses_a_bad_sink_url_before_anything_is_claimed(queue, url):
    before = digest(queue)
    assert "argument --sink:" in fails("work", queue, "--sink", url, "--until-empty", code=2)
    assert digest(queue) == before


@pytest.mark.process
@pytest.mark.parametrize("count", ["-1", "0"])
def test_work_max_jobs_must_be_at_least_one(queue, count):
    before = digest(queue)
    assert "argument --max-jobs:" in fails(
        "work", queue, "--sink", "http://127.0.0.1:9/events", "--max-jobs", count, code=2
    )
    assert digest(queue) == before


@pytest.mark.process
@pytest.mark.parametrize("number", [" 5", "+5", "1_0", "\u0665", "0x10", "5 ", "1e3"])
@pytest.mark.parametrize("option", ["--concurrency", "--gather-ms", "--max-jobs"])
def test_work_takes_plain_ascii_ints_only(queue, option, number):
    """int() would take spaces, "+", "_" and other scripts' digits: an option does not."""
    before = digest(queue)
    url = "http://127.0.0.1:9/events"
    assert f"argument {option}: must be an int" in fails(
        "work", queue, "--sink", url, option, number, code=2
    )
    assert digest(queue) == before


@pytest.mark.process
@pytest.mark.parametrize("seconds", [" 1", "1_0", "\u0661", "inf", "nan", "0x1"])
def test_a_timeout_is_a_plain_ascii_number(queue, seconds):
    assert "argument --timeout-s: must be a number" in fails(
        "work", queue, "--sink", "http://127.0.0.1:9/events", "--timeout-s", seconds, code=2
    )


@pytest.mark.process
def test_enqueue_of_deeply_nested_json_is_one_line_and_writes_nothing(queue, tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"id": "b", "qty": 1}\n' + "[" * 100_000 + "\n")
    before = digest(queue)
    assert fails("enqueue", queue, deep).endswith(":2: nested too deeply\n")
    assert digest(queue) == before


@pytest.mark.process
@pytest.mark.parametrize("port", ["70000", "-1"])
def test_sink_port_out_of_range_is_usage_and_creates_no_db(tmp_path, port):
    assert "argument --port:" in fails("sink", "--db", tmp_path / "s.db", "--port", port, code=2)
    assert not (tmp_path / "s.db").exists()


@pytest.mark.process
def test_sink_on_a_port_in_use_fails_and_creates_no_db(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "address already in use" in fails("sink", "--db", tmp_path / "s.db", "--port", port)
    assert not (tmp_path / "s.db").exists()


@pytest.mark.process
def test_sink_refuses_a_token_that_no_header_could_carry(tmp_path):
    assert "auth_token" in fails("sink", "--db", tmp_path / "s.db", "--auth-token", "tök", code=2)
    assert not (tmp_path / "s.db").exists()


@pytest.mark.process
@pytest.mark.parametrize("option", [("--delay-ms", "-1"), ("--fail-rate", "nan")])
def test_lab_refuses_bad_fault_options_in_one_line(tmp_path, option):
    assert f"argument {option[0]}:" in fails("lab", "--dir", tmp_path / "lab", *option, code=2)
    assert not (tmp_path / "lab").exists()


@pytest.mark.process
def test_outbox_pending_and_dispatch_never_add_tables(queue):
    before = digest(queue)
    assert "argument --limit:" in fails("outbox", "pending", queue, "--limit", "0", code=2)
    assert "is not a source DB (no outbox table)" in fails("outbox", "pending", queue)
    assert "is not a source DB" in fails(
        "outbox", "dispatch", queue, "--sink", "http://127.0.0.1:9/events"
    )
    assert digest(queue) == before


@pytest.mark.process
def test_outbox_commands_with_bad_input_create_no_file(tmp_path):
    new = tmp_path / "new.db"
    assert "event id" in fails("outbox", "accept", new, "--id", "bad id", "--qty", "1")
    assert "no source DB at" in fails("outbox", "pending", new)
    assert "argument --sink:" in fails(
        "outbox", "dispatch", new, "--sink", "http://127.0.0.1:99999/events", code=2
    )
    assert not new.exists()


@pytest.mark.process
def test_audit_names_a_file_that_is_not_a_sink_db_once(queue):
    error = fails("audit", queue, "--sink-db", queue)
    assert "is not a sink DB (no stock_moves table)" in error and "DB DB" not in error


@pytest.mark.process
@pytest.mark.parametrize("args", [("--id", "b"), ("-", "--id", "b", "--qty", "2")])
def test_enqueue_needs_either_id_and_qty_or_an_input(queue, args):
    before = digest(queue)
    fails("enqueue", queue, *args, code=2, stdin="")
    assert digest(queue) == before


def opens(pid, path, within_s):
    """Whether process ``pid`` has ``path`` open within ``within_s`` seconds."""
    wanted, fds = os.path.realpath(path), pathlib.Path(f"/proc/{pid}/fd")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for fd in fds.iterdir() if fds.exists() else ():
            with contextlib.suppress(OSError):
                if os.readlink(fd) == wanted:
                    return True
        time.sleep(0.01)
    return False


@pytest.mark.process
def test_work_waits_for_a_queue_another_process_holds_exclusively(queue, tmp_path):
    """``work`` started while the file is locked waits with the bounded backoff of BEGIN
    (about 9 s in all) instead of failing after a second; a lock held 1.3 s after the worker
    opened the file is waited out."""
    holder = sqlite3.connect(queue, isolation_level=None)
    with sink_process(tmp_path / "sink.db") as url:
        holder.execute("BEGIN EXCLUSIVE")
        work = worker(queue, url, "--until-empty", "--json", stdout=PIPE, stderr=PIPE)
        try:
            assert opens(work.pid, queue, within_s=30)
            time.sleep(1.3)  # the fault: the lock outlasts a busy timeout (1 s)
            holder.execute("COMMIT")
            out, err = work.communicate(timeout=30)
        finally:
            holder.close()
            stop(work)
    assert work.returncode == 0, err
    assert '"done": 1' in out


@pytest.mark.process
@pytest.mark.parametrize(
    ("code", "args"),
    [
        (1, ["stats", "postgresql://u:Hunter%zz2@127.0.0.1:9/q"]),  # libpq quotes a bad %
        (1, ["stats", "postgresql://u@127.0.0.1:9/q?password=Hunter%zz2"]),
        (1, ["stats", "postgresql://u:Hunter%20zz2@127.0.0.1:9/q"]),  # (decoded: a space)
        (1, ["stats", "postgresql://127.0.0.1:Hunter/zz2@127.0.0.1:9/q"]),  # a '/' in it
        (2, ["stats", "postgresql+psycopg://u:Hunterzz2@127.0.0.1:9/q"]),
        (2, ["init", "pgsql://u:Hunterzz2@127.0.0.1:9/q"]),
        (2, ["init", "host=127.0.0.1 user=u password=Hunterzz2 dbname=q"]),
        (2, ["init", "host=x.db"]),  # (a file of that name: by its absolute path, below)
        (2, ["init", ":memory:"]),  # (an in-memory database keeps nothing)
        (2, ["init", "file:x.db?mode=memory"]),
        (2, ["sink", "--db", "file:x.db?mode=memory", "--port", "0"]),
        (2, ["init", "file:x.db"]),  # (SQLite opens x.db)
        (2, ["init", "x.db-wal"]),  # (x.db's write-ahead log: deleted as x.db opens)
        (2, ["stats", "x.db-journal"]),
        (2, ["outbox", "pending", "postgresql://u:Hunterzz2@127.0.0.1:9/q"]),
    ],
)
def test_a_target_that_cannot_be_used_is_one_line_without_its_password_nor_a_file(
    tmp_path, code, args
):
    """libpq quotes a token it cannot read (a bad percent-encoding, a password's piece read
    as a port); a URL of another scheme was taken for a file path, a libpq keyword string
    made a queue file named after its password, and the outbox echoed a URL as its path;
    ``:memory:`` and ``file:`` URIs opened an in-memory database (a sink there answered
    "applied" and kept nothing), and ``x.db-wal`` a file SQLite deletes as ``x.db`` opens."""
    run = subprocess.run(
        procs.command(*args), capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    said = run.stdout + run.stderr
    assert run.returncode == code, said
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert "Hunter" not in said and "zz2" not in said, said
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_a_file_named_like_a_keyword_string_or_a_uri_is_given_by_its_absolute_path(tmp_path):
    for name in ("host=x.db", "file:x.db"):
        ok("init", tmp_path / name)
        assert (tmp_path / name).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file:x.db", "host=x.db"]


@pytest.mark.process
def test_enqueue_refuses_a_line_past_its_bound_without_holding_it(queue, tmp_path):
    """A stream without newlines (``/dev/zero``) was read as one line for as long as it
    grew: gigabytes of memory in seconds, and no answer."""
    before = digest(queue)
    said = fails("enqueue", queue, "/dev/zero")
    assert said.startswith("asnackq enqueue: /dev/zero:1: a line over 1,576,960 characters")
    long = tmp_path / "long.jsonl"
    good = '{"id": "b", "qty": 1}'
    long.write_text(f"{good}\n{good:<10096}\n{good:<10097}\n")  # (the bound, then past it)
    said = fails("enqueue", queue, long, "--max-event-bytes", "1000")
    assert ":3: a line over 10,096 characters (an event is at most --max-event-bytes 1,000" in said
    assert digest(queue) == before


@pytest.mark.process
@pytest.mark.parametrize("where", ["a directory", "no directory"])
def test_lab_refuses_a_json_file_it_cannot_write_before_the_run(tmp_path, where):
    """``--json DIR`` ran the whole experiment, then failed on the file (its results lost)."""
    path = tmp_path if where == "a directory" else tmp_path / "none" / "r.json"
    said = fails("lab", "--jobs", "1", "--json", path, code=2)
    assert said.startswith(f"asnackq lab: --json {path}: {where}"), said
    assert sorted(tmp_path.iterdir()) == []
