"""Every command that writes, on a file that is not its own (another application's
database, the other half of asnackq, a directory, a FIFO, a text file): one line, exit 1,
and every byte as it was; new and empty databases, and its own kind, still work."""

from __future__ import annotations

import hashlib
import os
import sqlite3

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.core.inbox import SINK_SCHEMA
from asnackq.sink.stock import open_sink_db

from .test_cli import fails, ok

SINK = "http://127.0.0.1:9/events"
WRITERS = {
    "init": lambda path: ("init", path),
    "enqueue": lambda path: ("enqueue", path, "--id", "a", "--qty", "1"),
    "enqueue-lines": lambda path: ("enqueue", path, "-"),
    "redrive": lambda path: ("redrive", path, "a", "--ttl-ms", "1000", "--note", "n"),
    "work": lambda path: ("work", path, "--sink", SINK, "--until-empty"),
    "sink": lambda path: ("sink", "--db", path),
    "outbox-accept": lambda path: ("outbox", "accept", path, "--id", "a", "--qty", "1"),
}


def snapshot(directory):
    """Every name in ``directory`` with its bytes (a FIFO or a directory by its kind)."""
    found = {}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if path.is_file():
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[name] = "fifo" if path.is_fifo() else "dir"
    return found


def database(path, *statements):
    con = sqlite3.connect(path)
    for statement in statements:
        con.execute(statement)
    con.commit()
    con.close()
    return path


@pytest.fixture
def files(tmp_path):
    """One file of each foreign kind, by name."""
    made = {
        "app": database(
            tmp_path / "app.db",
            "CREATE TABLE users (id, name)",
            "INSERT INTO users VALUES (1, 'x')",
        ),
        "jobs-alone": database(tmp_path / "jobs.db", "CREATE TABLE jobs (id TEXT, qty INT)"),
        "queue-columns": database(
            tmp_path / "cols.db",
            *(s.replace("reason TEXT)", "why TEXT)") for s in w.SCHEMA),
        ),
        "queue": tmp_path / "queue.db",
        "sink": database(tmp_path / "sink.db", *SINK_SCHEMA),
        "text": tmp_path / "notes.txt",
        "fifo": tmp_path / "fifo",
        "directory": tmp_path / "directory",
    }
    w.open_queue(made["queue"]).close()
    made["text"].write_text("not a database\n" * 10)
    os.mkfifo(made["fifo"])
    made["directory"].mkdir()
    return made


CASES = [
    *((kind, writer) for kind in ("app", "text", "fifo", "directory") for writer in WRITERS),
    *(("jobs-alone", writer) for writer in ("init", "enqueue")),
    *(("queue-columns", writer) for writer in ("init", "work")),
    ("queue", "sink"),
    *(("sink", writer) for writer in ("init", "enqueue", "work", "outbox-accept")),
    ("queue", "outbox-accept"),
]


@pytest.mark.process
@pytest.mark.parametrize(("kind", "writer"), CASES)
def test_no_command_writes_into_a_file_that_is_not_its_own(files, tmp_path, kind, writer):
    before = snapshot(tmp_path)
    said = fails(*WRITERS[writer](files[kind]), stdin='{"id": "a", "qty": 1}\n', timeout=30)
    assert str(files[kind]) in said, said
    assert snapshot(tmp_path) == before  # no byte, no journal, no WAL


async def test_the_library_refuses_the_same_files(files, tmp_path):
    before = snapshot(tmp_path)
    for kind in ("app", "sink", "text", "fifo", "directory"):
        with pytest.raises(ValueError, match=r"refusing|not a database file|not a SQLite"):
            await AsyncQueue.connect(files[kind])
    for kind in ("app", "queue"):
        with pytest.raises(ValueError, match="holds other tables"):
            await open_sink_db(files[kind])
    assert snapshot(tmp_path) == before


@pytest.mark.process
def test_new_and_empty_databases_and_its_own_kind_still_work(files, tmp_path):
    empty = tmp_path / "empty.db"
    empty.touch()
    no_tables = database(tmp_path / "no-tables.db", "PRAGMA user_version = 7")
    for path in (empty, no_tables, tmp_path / "new.db"):
        assert ok("init", path, "--json")["created"] is True
        assert ok("init", path, "--json")["created"] is False
    ok("enqueue", files["queue"], "--id", "a", "--qty", "1")
    assert "no queue at" in fails("enqueue", tmp_path / "absent.db", "--id", "a", "--qty", "1")
    assert not (tmp_path / "absent.db").exists()
