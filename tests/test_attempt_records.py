"""Each request a Dispatcher makes is kept: status, latency, verdict and the first KiB of
the answer, written with the next cycle, on SQLite and PostgreSQL; shown by ``asnackq
history`` and the dashboard's job inspector."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import epoch_ms
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.ops.watcher import Watcher
from asnackq.store import attempts
from asnackq.wire.send import AsyncHttpSender

from .pgdb import query
from .sinks import peer, serving

BREAKER = BreakerPolicy(after=1, base_ms=20, max_ms=100)


def scripted(answers: list[tuple[int, bytes, dict[str, str]]]) -> web.Application:
    """A receiver answering ``answers`` in turn (the last one from then on)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        status, body, headers = answers.pop(0) if len(answers) > 1 else answers[0]
        return web.Response(status=status, body=body, headers=headers)

    return peer(handler)


async def deliver(target: str, answers, *, keep: bool = True, job: str = "j1") -> None:
    async with AsyncQueue.open(target) as queue, serving(scripted(answers)) as receiver:
        await queue.enqueue_many([({"id": job, "qty": 1}, 60_000, 3)])
        async with AsyncHttpSender(receiver.url, success="2xx") as send:
            summary = await Dispatcher(
                queue, send, owner="d1", concurrency=1, breaker=BREAKER, keep_attempts=keep
            ).run(until_empty=True)
    assert summary.done == 1


def kept(target: str | Path, job: str = "j1") -> list[tuple]:
    sql = attempts.SQL_OF_JOB
    if isinstance(target, str) and target.startswith("postgresql"):
        pg = attempts.SQL_OF_JOB_PG.replace("?", "%s")
        return [tuple(r) for r in query(target, pg, (job, job))]
    import sqlite3

    con = sqlite3.connect(target)
    try:
        if not con.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'asnackq_attempts'"
        ).fetchone()[0]:
            return []  # (a run that kept none made no table)
        return con.execute(sql, (job, job)).fetchall()
    finally:
        con.close()


ANSWERS = [
    (503, b"down for maintenance", {}),
    (429, b"slow down", {"Retry-After": "0"}),
    (410, b"", {}),
    (500, b'{"error": "boom"}', {}),
    (204, b"", {}),
]


def check_story(rows: list[tuple]) -> None:
    # (token, attempt, at_ms, status, latency_ms, verdict, answer), oldest first
    assert [(r[0], r[1], r[3], r[5], r[6]) for r in rows] == [
        (1, 1, 503, "away", "down for maintenance"),
        (1, 1, 429, "overloaded", "slow down"),
        (1, 1, 410, "gone", ""),
        (1, 1, 500, "retry", '{"error": "boom"}'),  # the first attempt's end
        (2, 2, 204, "ok", ""),  # the second attempt, under a new token
    ]
    assert all(r[4] >= 0 for r in rows) and [r[2] for r in rows] == sorted(r[2] for r in rows)


async def test_each_request_is_kept_in_order_on_sqlite(db: Path) -> None:
    await deliver(str(db), list(ANSWERS))
    check_story(kept(db))


async def test_each_request_is_kept_in_order_on_postgresql(pg_db) -> None:
    url = pg_db()
    await deliver(url, list(ANSWERS))
    check_story(kept(url))


async def test_an_answer_is_kept_to_its_first_kib_and_undecodable_bytes_are_replaced(
    db: Path,
) -> None:
    body = b"\xff\xfe" + "é".encode() * 2000
    await deliver(str(db), [(200, body, {})])
    [row] = kept(db)
    assert row[3] == 200 and row[5] == "ok"
    assert row[6] == body[:1024].decode("utf-8", errors="replace") and len(row[6]) <= 1024


async def test_an_answers_characters_are_kept_as_they_came_on_postgresql(pg_db) -> None:
    """The records go to PostgreSQL as one JSON array: quotes, backslashes, control
    characters, escapes' look-alikes, NUL and non-ASCII come back as the excerpt made them."""
    body = b'\x00"\\\n\t\\u0041\xff' + "é😀\u2028".encode() + b'}{][,"'
    url = pg_db()
    await deliver(url, [(200, body, {})])
    [row] = kept(url)
    assert row[6] == attempts.excerpt(body) and "\x00" not in row[6] and "😀" in row[6]


async def test_a_claim_keeps_its_first_twenty_requests_only(db: Path) -> None:
    busy = [(429, b"busy", {"Retry-After": "0"})] * 30
    await deliver(str(db), [*busy, (204, b"", {})])
    rows = kept(db)
    assert len(rows) == attempts.PER_CLAIM
    assert {r[5] for r in rows} == {"overloaded"}


async def test_a_run_that_keeps_none_writes_no_table(db: Path) -> None:
    await deliver(str(db), [(204, b"", {})], keep=False)
    import sqlite3

    con = sqlite3.connect(db)
    names = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    con.close()
    assert "asnackq_attempts" not in names


async def test_a_request_the_database_could_not_take_is_kept_with_a_later_cycle(
    db: Path,
) -> None:
    """The records ride with the cycle after their request: a claim's records reach the
    table even when the request's cycle is the run's last."""
    await deliver(str(db), [(202, b"accepted", {})])
    assert [(r[3], r[6]) for r in kept(db)] == [(202, "accepted")]


async def test_the_inspector_shows_the_requests(db: Path) -> None:
    await deliver(str(db), list(ANSWERS))
    story = await Watcher(db, None).look_up("j1")
    assert story is not None
    assert [(a["status"], a["verdict"]) for a in story["attempts"]] == [
        (503, "away"),
        (429, "overloaded"),
        (410, "gone"),
        (500, "retry"),
        (204, "ok"),
    ]
    assert await Watcher(db, None).look_up("nothing") is None


@pytest.mark.process
def test_history_shows_the_requests_and_nothing_a_receiver_sends_reaches_the_terminal_raw(
    tmp_path: Path,
) -> None:
    db = tmp_path / "q.db"
    hostile = b"\x1b[31mred\x1b[0m [bold]loud[/bold] \x07bell"
    asyncio.run(deliver(str(db), [(500, hostile, {}), (204, b"", {})]))
    shown = subprocess.run(
        [sys.executable, "-m", "asnackq", "history", str(db), "j1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "2 requests" in shown.stdout and "retry" in shown.stdout and "204" in shown.stdout
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert "[bold]loud[/bold]" in shown.stdout  # shown as sent, not as console markup
    as_json = subprocess.run(
        [sys.executable, "-m", "asnackq", "history", str(db), "j1", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    requests = json.loads(as_json.stdout)["requests"]
    assert [r["status"] for r in requests] == [500, 204]
    assert requests[0]["answer"] == hostile.decode()


async def test_a_request_with_no_answer_keeps_why(db: Path) -> None:
    """A send refused before anything goes out (the guard) keeps its one-line reason."""
    async with AsyncQueue.open(db) as queue:
        await queue.enqueue_many([({"id": "j1", "qty": 1}, 60_000, 3)])
        sender = AsyncHttpSender(
            "http://hooks.example:8080/in", allow_remote=True, lookup=lambda h, p: ["127.0.0.1"]
        )
        async with sender as send:
            summary = await Dispatcher(queue, send, owner="d1", concurrency=1).run()
    assert summary.dead == 1
    [row] = kept(db)
    assert (row[3], row[5]) == (None, "permanent")
    assert "hooks.example" in row[6] and "127.0.0.1 is a loopback address" in row[6]


async def test_workers_starting_together_create_the_table_once_on_postgresql(pg_db) -> None:
    url = pg_db()
    async with contextlib.AsyncExitStack() as stack:
        queues = [await stack.enter_async_context(AsyncQueue.open(url)) for _ in range(8)]
        for _ in range(3):
            await asyncio.gather(*(queue.keep_attempts() for queue in queues))
    assert query(url, "SELECT count(*) FROM asnackq_attempts") == [(0,)]


@pytest.mark.process
def test_work_keeps_the_requests_unless_told_not_to(tmp_path: Path) -> None:
    from .test_webhook_senders import receiver

    for keep, kept_rows in (("--keep-attempts", 2), ("--no-keep-attempts", 0)):
        db = tmp_path / f"{keep}.db"
        subprocess.run([sys.executable, "-m", "asnackq", "init", str(db)], check=True)
        for i in range(2):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "asnackq",
                    "enqueue",
                    str(db),
                    "--id",
                    f"j{i}",
                    "--qty",
                    "1",
                ],
                check=True,
            )
        with receiver(secret=None) as server:
            run = subprocess.run(
                [sys.executable, "-m", "asnackq", "work", str(db), "--sink", server.url,
                 "--success", "2xx", "--until-empty", keep],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert len(kept(db, "j0") + kept(db, "j1")) == kept_rows


@pytest.mark.parametrize("count", [0, 1])
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
async def test_a_cycles_rows_are_kept_in_order_with_their_characters(
    db: Path, pg_db, store: str, count: int
) -> None:
    """One cycle's rows, written alone (nothing else to do) or with the claims' reads: a
    job's two requests and another's, sent as one JSON array to SQLite and to PostgreSQL,
    come back in order, each answer as the excerpt made it."""
    target = str(db) if store == "sqlite" else pg_db()
    odd = attempts.excerpt(b'\x00"\\\n\t\\u0041\xff' + "é😀\u2028".encode() + b'}{][,"')
    rows = [
        attempts.Record("j1", 1, 1, 1_000, 503, 7, "away", odd),
        attempts.Record("j2", 1, 1, 1_001, None, 0, "timing_out", "no answer in 0.5 s"),
        attempts.Record("j1", 1, 1, 1_002, 200, 3, "ok", ""),
    ]
    async with AsyncQueue.open(target) as queue:
        await queue.keep_attempts()
        await queue.enqueue_many([({"id": "j3", "qty": 1}, 60_000, 3)])
        _, _, claimed, _ = await queue.cycle([], [], "d1", epoch_ms(), 1_000, count, attempts=rows)
        assert len(claimed) == count
    assert kept(target, "j1") == [tuple(rows[0][1:]), tuple(rows[2][1:])]
    assert kept(target, "j2") == [tuple(rows[1][1:])]


# The table as an earlier asnackq made it: no ``job``, an index of every row by id.
EARLIER = {
    "sqlite": """CREATE TABLE asnackq_attempts (seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL, at_ms INTEGER NOT NULL,
  status INTEGER, latency_ms INTEGER NOT NULL, verdict TEXT NOT NULL, answer TEXT NOT NULL)""",
    "postgresql": """CREATE TABLE asnackq_attempts (
  seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, id TEXT NOT NULL,
  token BIGINT NOT NULL, attempt INTEGER NOT NULL, at_ms BIGINT NOT NULL, status INTEGER,
  latency_ms INTEGER NOT NULL, verdict TEXT NOT NULL, answer TEXT NOT NULL)""",
}
INDEXES = {
    "sqlite": "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = "
    "'asnackq_attempts' AND sql IS NOT NULL",
    "postgresql": "SELECT indexname FROM pg_indexes WHERE tablename = 'asnackq_attempts'"
    " AND indexname <> 'asnackq_attempts_pkey'",
}


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgresql", marks=pytest.mark.process)])
async def test_an_earlier_table_is_read_by_id_then_keyed_by_job_keeping_its_rows(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A table of an earlier asnackq is read as it is (by id); a run that keeps the answers
    gives it the ``job`` column and its indexes, its rows kept and still found by id beside
    the new ones, found by the job's seq; a purge takes both."""
    from asnackq.ops.purge import purge

    from .conftest import execute

    where = str(tmp_path / "q.db") if store == "sqlite" else request.getfixturevalue("pg_db")()
    async with AsyncQueue.open(where) as queue:
        assert await queue.enqueue({"id": "j1", "qty": 1})
    execute(where, EARLIER[store])
    execute(where, "CREATE INDEX asnackq_attempts_by_job ON asnackq_attempts(id, seq)")
    execute(
        where,
        "INSERT INTO asnackq_attempts (id, token, attempt, at_ms, status, latency_ms, verdict,"
        " answer) VALUES ('j1', 1, 1, 5, 503, 2, 'away', 'earlier'), ('j0', 1, 1, 6, 503, 2,"
        " 'away', 'not j1')",
    )

    async def answers() -> list[tuple[int, str]]:
        story = await Watcher(where, None).look_up("j1")
        assert story is not None
        return [(a["status"], a["answer"]) for a in story["attempts"]]

    assert await answers() == [(503, "earlier")]  # (read by id: no job column yet)
    await deliver(where, [(200, b"now", {})])
    assert await answers() == [(503, "earlier"), (200, "now")]
    [(seq,)] = execute(where, "SELECT seq FROM jobs WHERE id = 'j1'")
    assert execute(where, "SELECT id, job FROM asnackq_attempts ORDER BY seq") == [
        ("j1", None),
        ("j0", None),
        ("j1", seq),
    ]
    assert sorted(row[0] for row in execute(where, INDEXES[store])) == [
        "asnackq_attempts_keyed",
        "asnackq_attempts_unkeyed",
    ]
    async with AsyncQueue.open(where) as queue:  # (created again: a no-op)
        await queue.keep_attempts()
    assert await answers() == [(503, "earlier"), (200, "now")]
    assert purge(where, epoch_ms() + 1, ("done",), epoch_ms()) == {"done": 1}
    assert execute(where, "SELECT id, job FROM asnackq_attempts") == [("j0", None)]


async def test_the_reads_and_the_purges_deletes_can_use_their_indexes_on_postgresql(
    pg_db,
) -> None:
    """Each partial index is implied by its statement's condition: with sequential scans
    off, the planner takes it (else a purge batch would read the whole table)."""
    import psycopg

    from asnackq.store import retention

    url = pg_db()
    async with AsyncQueue.open(url) as queue:
        await queue.keep_attempts()
    texts = retention.PG_TEXTS
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("SET enable_seqscan = off")
        for sql, params, indexes in [
            (
                attempts.SQL_OF_JOB_PG.replace("?", "%s"),
                ("j1", "j1"),
                ("asnackq_attempts_keyed", "asnackq_attempts_unkeyed"),
            ),
            (texts[retention.SQL_ATTEMPTS], ("[1, 2]",), ("asnackq_attempts_keyed",)),
            (texts[retention.SQL_ATTEMPTS_UNKEYED], ('["a"]',), ("asnackq_attempts_unkeyed",)),
        ]:
            plan = json.dumps(con.execute(f"EXPLAIN (FORMAT JSON) {sql}", params).fetchall())
            for index in indexes:
                assert index in plan, (sql, plan)
