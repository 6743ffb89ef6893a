"""A cycle's reads of a row per job as one row on SQLite (``sqlite_aio.ROWS``), and its
counted writes without ``RETURNING`` (``sqlite_aio.COUNTED``).

Each must give the plan exactly what the statement itself gives: the same rows, the same
values of the same types, in the same order; a value JSON does not carry (a REAL, a BLOB
another program wrote) read again as it is; the same rows changed, counted the same.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.store import sqlite_aio
from asnackq.store.sqlite_aio import SqliteStore

from .settles import NOW, ODD_IDS

_INSERT = """INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,
  deadline, owner, lease_until, reason) VALUES (?, ?, ?, ?, 3, ?, ?, ?, ?, ?, NULL)"""
ENDPOINT = "hooks-a"
LANES = (
    lanes.Lane(ENDPOINT),
    lanes.Lane(ENDPOINT, ordered=True),
    lanes.PLAIN,
)


def kinds(job: str, n: int) -> list[tuple[Any, ...]]:
    """``job`` as each kind of row a claim or a settle meets (ids suffixed by kind)."""
    far = 2**62 + n  # (beyond a double's exact integers: JSON must keep every digit)
    return [
        (f"{job}/fresh", n, "pending", 0, 0, NOW - n, far, None, None),
        (f"{job}/retry", n, "pending", 1, 1, NOW - 1, far, None, None),
        (f"{job}/later", n, "pending", 1, 1, NOW + 60_000, far, None, None),
        (f"{job}/lapsed", n, "leased", 1, 2, NOW - 5, far, "caf\u00e9 \u2603", NOW - 1),
        (f"{job}/lost", n, "leased", 1, 4, NOW - 5, far, 'o"w', NOW - 1),
        (f"{job}/held", -n, "leased", 1, 1, NOW - 5, far, "o", NOW + 9_000),
        (f"{job}/done", n, "done", 1, 1, NOW - 5, far, None, None),
        (f"{job}/spent", n, "pending", 3, 3, NOW - 5, NOW - 2, None, None),
    ]


def filled(path: Path) -> list[str]:
    """A queue with jobs of every kind, a lane's deliveries among them (keyed and not), a
    redrive; returns every id."""
    con = w.open_queue(path)
    for sql in (lanes.DELIVERIES, lanes.LANE_INDEX, lanes.KEY_INDEX):
        con.execute(sql)
    ids = []
    plain = ODD_IDS + [f"j{n}" for n in range(12)]
    deliveries = [lanes.delivery_id(ENDPOINT, n) for n in range(12)]
    for n, job in enumerate(plain + deliveries):
        for row in kinds(job, n):
            con.execute(_INSERT, row)
            ids.append(row[0])
    for n, job in enumerate(deliveries):
        for kind in ("fresh", "retry", "lapsed", "held"):
            key = None if n % 3 == 0 else f"k{n % 2}"
            con.execute(
                "INSERT INTO asnackq_deliveries VALUES (?, ?, ?, ?)",
                (f"{job}/{kind}", f"e{n}", ENDPOINT, key),
            )
    con.execute("INSERT INTO redrives (id, token, at_ms, note) VALUES ('j3/lost', 2, 1, 'x')")
    con.commit()
    con.close()
    return ids


def claims_params() -> list[tuple[str, dict[str, Any]]]:
    """Every claim text of ``ROWS`` (the core's and each lane's), with parameters."""
    cases = []
    for sql in (
        w.SQL_NEXT_CLAIMABLE,
        w.SQL_NEXT_FRESH,
        w.SQL_NEXT_RECLAIMABLE,
        w.SQL_NEXT_FRESH_RECLAIMING,
    ):
        for n in (1, 7, 1024):
            for losses in (1, 3):
                params = {"now": NOW, "n": n, "losses": losses}
                cases.append((sql, params))
                for lane in LANES:
                    cases.append(lanes.text(lane, sql, params))
    return cases


async def as_driver(path: Path, step: w.Sql) -> list[Any]:
    async with aiosqlite.connect(path) as db:
        rows = await sqlite_aio.statement(db, step)
        await db.commit()
        return rows


def as_statement(path: Path, step: w.Sql) -> list[Any]:
    with sqlite3.connect(path) as con:
        return [tuple(row) for row in con.execute(step.sql, step.params)]


def test_every_text_of_rows_is_a_claim_or_the_jobs_read_in_its_statements_order():
    """A claim's rows by seq (column 0), or by id (column 1) where a lane's last ``ORDER
    BY`` is its ids'; the jobs read in no order."""
    claims = {sql for sql, _ in claims_params()}
    assert set(sqlite_aio.ROWS) == claims | {w.SQL_JOBS}
    orders = {sql: text.order for sql, text in sqlite_aio.ROWS.items()}
    assert orders.pop(w.SQL_JOBS) is None
    by_id = {
        lane[sql]
        for lane in (lanes.LANE_TEXTS, lanes.ORDERED_TEXTS)
        for sql in (w.SQL_NEXT_FRESH, w.SQL_NEXT_FRESH_RECLAIMING)
    }
    assert {sql for sql, order in orders.items() if order == 1} == by_id
    assert all(order == 0 for sql, order in orders.items() if sql not in by_id)
    for sql in by_id:
        assert sql.rstrip().endswith("ORDER BY id LIMIT :n")


async def test_a_claims_rows_as_one_are_the_statements_rows_in_its_order(tmp_path):
    path = tmp_path / "q.db"
    filled(path)
    found = 0
    for sql, params in claims_params():
        step = w.Read(sql, params)
        expected = as_statement(path, step)
        assert await as_driver(path, step) == expected, " ".join(sql.split())[:80]
        found += len(expected)
    assert found > 1_000  # (every kind of claim found jobs to take)


async def test_the_jobs_read_as_one_is_the_statements_rows(tmp_path):
    """ODD_IDS (quotes, backslashes, control characters, emoji, ids that read as numbers),
    NULLs, negative and 63-bit integers, ids that are no job."""
    path = tmp_path / "q.db"
    ids = filled(path)
    for chosen in (ids, ids[::7], ["nobody", ids[3]], []):
        step = w.Read(w.SQL_JOBS, (w.json_set(chosen),))
        got = await as_driver(path, step)
        assert sorted(got, key=repr) == sorted(as_statement(path, step), key=repr)
        assert len(got) == len(set(chosen) - {"nobody"})
        if chosen == ids:
            assert any(row[0] < 0 and row[5] > 2**62 and row[6] == "o" for row in got)
            assert any(row[6] is None and row[8] in ODD_IDS[0] + "/fresh" for row in got)


@pytest.mark.parametrize(
    "odd",
    [0.1 + 0.2, 1.5, float("inf"), b"\x00\xffblob"],
    ids=["17 digits", "real", "infinity", "blob"],
)
async def test_a_value_json_does_not_carry_is_read_again_exactly(tmp_path, odd):
    """Another program's REAL or BLOB in a job (in ``qty``, ``owner`` or the id): the rows
    are the statement's own, value for value and type for type."""
    path = tmp_path / "q.db"
    filled(path)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE jobs SET qty = ? WHERE id = 'j2/fresh'", (odd,))
        con.execute("UPDATE jobs SET owner = ? WHERE id = 'j4/lapsed'", (odd,))
        if isinstance(odd, bytes):
            con.execute("UPDATE jobs SET id = ? WHERE id = 'j5/fresh'", (odd,))
    for step in (
        w.Read(w.SQL_NEXT_FRESH_RECLAIMING, {"now": NOW, "n": 500}),
        w.Read(w.SQL_NEXT_RECLAIMABLE, {"now": NOW, "n": 500, "losses": 3}),
        w.Read(w.SQL_JOBS, (w.json_set(["j2/fresh", "j4/lapsed", "j1/fresh"]),)),
    ):
        expected = as_statement(path, step)
        got = await as_driver(path, step)
        assert got == expected
        assert [tuple(map(type, row)) for row in got] == [tuple(map(type, row)) for row in expected]
        assert any(odd in row for row in got)


def test_a_json_array_with_a_real_or_a_null_row_is_not_taken():
    """(SQLite 3.40 writes an infinite REAL as ``Inf``.)"""
    assert sqlite_aio.rows_of('[[2, "b"], [1, "c"]]', 0) == [(1, "c"), (2, "b")]
    assert sqlite_aio.rows_of('[[2, "b"], [1, "c"]]', 1) == [(2, "b"), (1, "c")]
    assert sqlite_aio.rows_of('[[2, "b"], [1, "c"]]', None) == [(2, "b"), (1, "c")]
    for array in ("[[1, 0.5]]", "[[1, 9e999]]", "[[1, Inf]]", '[[1, "a"], null]'):
        with pytest.raises(sqlite_aio.Inexact):
            sqlite_aio.rows_of(array, 0)


@pytest.mark.parametrize("many", [False, True], ids=["one", "set"])
@pytest.mark.parametrize("core", [w.SQL_LEASE, w.SQL_LEASE_RECLAIMING, w.SQL_POISON])
async def test_a_counted_write_changes_what_the_statement_changes(tmp_path, core, many):
    """The lease and the poisoning without ``RETURNING``: the same rows changed (some of
    the seqs named are no longer pending or leased), one row of reply per row changed."""
    path = tmp_path / "q.db"
    filled(path)
    copy = tmp_path / "copy.db"
    shutil.copyfile(path, copy)
    seqs = list(range(1, 400, 3)) if many else [4]
    keys: tuple[Any, ...] = (w.json_set(seqs),) if many else (seqs[0],)
    head = () if core == w.SQL_POISON else ("w9", NOW + 1_000)
    sql = core if many else w.ONE[core]
    assert sqlite_aio.COUNTED[sql] != sql
    got = await as_driver(path, w.Sql(sql, (*head, *keys)))
    with sqlite3.connect(copy) as con:
        returned = con.execute(sql, (*head, *keys)).fetchall()
    assert len(got) == len(returned) > 0
    with sqlite3.connect(path) as a, sqlite3.connect(copy) as b:
        query = "SELECT * FROM jobs ORDER BY seq"
        assert a.execute(query).fetchall() == b.execute(query).fetchall()


async def test_a_batch_sent_at_once_reads_a_row_again_and_a_write_after_is_not_seen(tmp_path):
    """On a store's own connection: a batch's read with a REAL in it is read again after the
    reads sent with it (its reply the statement's own); a read followed by a write in its
    batch is read as it is, before the write (what it gives is what was there)."""
    path = tmp_path / "q.db"
    filled(path)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE jobs SET qty = 2.5 WHERE id = 'j2/fresh'")
    fresh = w.Read(w.SQL_NEXT_FRESH_RECLAIMING, {"now": NOW, "n": 500})
    jobs = w.Read(w.SQL_JOBS, (w.json_set(["j2/fresh", "j3/retry"]),))
    write = w.Sql("UPDATE jobs SET qty = 7 WHERE id IN ('j2/fresh', 'j1/fresh')", ())
    before = [as_statement(path, fresh), as_statement(path, jobs)]

    def plan() -> w.Plan[list[Any]]:
        replies = yield w.Batch((fresh, jobs))
        after = yield w.Batch((fresh, write, jobs))
        return [replies, after], False

    store = await SqliteStore.open(path, w.SCHEMA, 5.0)
    try:
        replies, after = await store.run(plan)
    finally:
        await store.close()
    assert replies == before
    assert after[0] == before[0]  # (read before the write: as it is)
    assert after[1] == []
    assert sorted(after[2], key=repr) == sorted(
        [(7, *row[1:]) if row[-1] == "j2/fresh" else row for row in before[1]], key=repr
    )


async def test_a_lanes_rows_ordered_by_id_keep_that_order_where_seq_order_differs(tmp_path):
    """Deliveries whose ids run against their seqs (another program's rows): each lane's
    claims give the statement's own order, and a Dispatcher's cycle on the store leases the
    jobs the core's own driver leases."""
    path = tmp_path / "q.db"
    con = w.open_queue(path)
    for sql in (lanes.DELIVERIES, lanes.LANE_INDEX, lanes.KEY_INDEX):
        con.execute(sql)
    for n in reversed(range(9)):
        job = lanes.delivery_id(ENDPOINT, n)
        con.execute(_INSERT, (job, 1, "pending", 0, 0, NOW - 5, NOW + 60_000, None, None))
        con.execute(
            "INSERT INTO asnackq_deliveries VALUES (?, ?, ?, NULL)", (job, f"e{n}", ENDPOINT)
        )
    con.commit()
    con.close()
    for sql, params in claims_params():
        step = w.Read(sql, params)
        assert await as_driver(path, step) == as_statement(path, step)
    copy = tmp_path / "copy.db"
    shutil.copyfile(path, copy)
    lane = lanes.Lane(ENDPOINT)

    def cycle() -> w.Plan[Any]:
        plan = w.plan_cycle([], [], "o", NOW, 1_000, 1, 3, limits=w.PRODUCT)
        return lanes.substituted(plan, lane)

    with sqlite3.connect(copy, isolation_level=None) as sync:
        expected = w.drive(sync, cycle())
    store = await SqliteStore.open(path, w.SCHEMA, 5.0)
    try:
        got = await store.run(cycle)
    finally:
        await store.close()
    assert [t["id"] for t in got[2]] == [t["id"] for t in expected[2]]
    assert [t["id"] for t in got[2]] == [lanes.delivery_id(ENDPOINT, n) for n in range(4)]


class Limited(sqlite3.Connection):
    """A connection whose values are at most 100 kB (``SQLITE_LIMIT_LENGTH``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 100_000)


async def test_rows_too_long_for_one_value_are_read_as_they_are(tmp_path):
    """An application's connection with a low length limit: the array of a read's rows is
    longer than one value may be, and the rows are the statement's own."""
    path = tmp_path / "q.db"
    ids = [f"order-{n:058d}" for n in range(3_000)]
    con = w.open_queue(path)
    for job in ids:
        con.execute(_INSERT, (job, 1, "pending", 0, 0, NOW - 5, NOW + 60_000, None, None))
    con.commit()
    con.close()
    step = w.Read(w.SQL_JOBS, (w.json_set(ids[:1_300]),))  # (87 kB: the rows' 143 kB)
    claim = w.Read(w.SQL_NEXT_FRESH, {"now": NOW, "n": 1024})
    async with aiosqlite.connect(path, factory=Limited) as db:
        with pytest.raises(sqlite3.DataError):
            await db.execute_fetchall(sqlite_aio.ROWS[w.SQL_JOBS].text, step.params)
        got = await sqlite_aio.statement(db, step)
        claimed = await sqlite_aio.statement(db, claim)
    assert sorted(got) == sorted(as_statement(path, step)) and len(got) == 1_300
    assert claimed == as_statement(path, claim) and len(claimed) == 1024


async def test_a_caller_cancelled_while_a_row_is_read_again_waits_for_that_read(tmp_path):
    """The read again (a REAL in a job) is a statement sent: a caller cancelled while it runs
    gets its cancel only once it has landed, as for every statement ``sent`` sent."""
    path = tmp_path / "q.db"
    filled(path)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE jobs SET qty = 2.5 WHERE id = 'j2/fresh'")
    marks: list[str] = []
    started, release = threading.Event(), threading.Event()

    def trace(sql: str) -> None:  # (on the connection's thread)
        if sql.lstrip().startswith("SELECT seq"):  # the read again, as it is
            marks.append("read again")
            started.set()
            release.wait(60)  # (held until the caller has been cancelled)
            marks.append("landed")

    fresh = w.Read(w.SQL_NEXT_FRESH_RECLAIMING, {"now": NOW, "n": 50})
    async with aiosqlite.connect(path) as db:
        await db.set_trace_callback(trace)
        task = asyncio.ensure_future(sqlite_aio.sent(sqlite_aio.queued(db, [fresh, fresh])))
        try:
            assert await asyncio.to_thread(started.wait, 60)
            task.cancel()
            for _ in range(20):  # (the cancel reaches the caller: it keeps waiting)
                await asyncio.sleep(0)
            assert not task.done()
        finally:
            release.set()  # (a failure above ends the test at once, not after 60 s)
        with pytest.raises(asyncio.CancelledError):
            await task
        marks.append("cancelled")
        await db.set_trace_callback(None)
    assert marks[:3] == ["read again", "landed", "cancelled"]
