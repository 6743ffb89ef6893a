"""``asnackq purge``: done (and dead) jobs past a horizon go, with what was kept of them,
on SQLite and PostgreSQL; nothing else is touched."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from asnackq import ops
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.cli import main
from asnackq.core.endpoints import Endpoint
from asnackq.core.lanes import Lane
from asnackq.core.worker import epoch_ms
from asnackq.ops.purge import purge
from asnackq.store import job_traces
from asnackq.wire.send import AsyncHttpSender

from .conftest import execute
from .sinks import add_records, sink

T0 = 10**12
HORIZON = T0 + 5_000  # a cutoff after every end but one ("young" finishes after it)
SHORT, LONG = 1_000, 10**9


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.process)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "q.db")
    url: str = request.getfixturevalue("pg_db")()
    return url


async def finished(queue: AsyncQueue, job_id: str, ttl: int, outcome: str, at: int) -> None:
    """A job enqueued at ``at`` with ``ttl`` and claimed at once, then ended with ``outcome``
    (empty: left leased)."""
    assert await queue.enqueue({"id": job_id, "qty": 1}, now_ms=at, ttl_ms=ttl, max_attempts=3)
    ticket = await queue.claim("w", at, 500)
    assert ticket is not None and ticket["id"] == job_id
    if outcome:
        assert await queue.finish(ticket, outcome, at + 1) is not False


async def story(where: str) -> None:
    """Jobs of every kind, with requests, traces and a redrive kept of them."""
    async with AsyncQueue.open(where) as queue:
        await queue.keep_attempts()
        for n in range(3):
            await finished(queue, f"old-{n}", SHORT, "ok", T0)
        assert await queue.enqueue({"id": "young", "qty": 1}, now_ms=T0, ttl_ms=LONG)
        young = await queue.claim("w", T0, 3_600_000)  # (finished after the horizon, below)
        assert young is not None and young["id"] == "young"
        await finished(queue, "failed", SHORT, "permanent", T0)
        await finished(queue, "failed-late", LONG, "permanent", T0)  # (its deadline is ahead)
        await finished(queue, "again", SHORT, "permanent", T0)
        assert await queue.redrive("again", T0 + 2, SHORT, "fixed")
        ticket = await queue.claim("w", T0 + 2, 500)
        assert ticket is not None and ticket["id"] == "again"
        assert await queue.finish(ticket, "ok", T0 + 3) is not False
        await finished(queue, "held", SHORT, "", T0 + 3)
        assert await queue.enqueue({"id": "waiting", "qty": 1}, now_ms=T0, ttl_ms=SHORT)
        assert await queue.finish(young, "ok", HORIZON + 1) == "done"
    execute(where, job_traces.SQL_CREATE)
    for job_id in ("old-0", "young", "again"):
        execute(where, f"INSERT INTO asnackq_job_traces VALUES ('{job_id}', 'tp-{job_id}')")
        execute(
            where,
            "INSERT INTO asnackq_attempts (id, token, attempt, at_ms, status, latency_ms,"
            f" verdict, answer) VALUES ('{job_id}', 1, 1, {T0}, 200, 3, 'ok', '')",
        )  # (a row without its job's seq, as an earlier asnackq kept it)
    for job_id in ("old-1", "young"):  # (rows under their job's seq, as kept now)
        execute(
            where,
            "INSERT INTO asnackq_attempts (id, token, attempt, at_ms, status, latency_ms,"
            f" verdict, answer, job) SELECT id, 1, 2, {T0}, 200, 3, 'ok', '', seq FROM jobs"
            f" WHERE id = '{job_id}'",
        )


def ids(where: str, table: str, column: str = "id") -> list[str]:
    return sorted(row[0] for row in execute(where, f"SELECT {column} FROM {table}"))


async def test_a_purge_takes_done_jobs_past_the_horizon_and_what_was_kept_of_them(where):
    await story(where)
    assert sorted(execute(where, "SELECT id, status FROM jobs WHERE id = 'held'")) == [
        ("held", "leased")
    ]
    assert purge(where, HORIZON, ("done",), T0 + 10, limit=3) == {"done": 4}
    assert ids(where, "jobs") == ["failed", "failed-late", "held", "waiting", "young"]
    assert ids(where, "asnackq_attempts") == ["young", "young"]
    assert ids(where, "asnackq_job_traces", "job_id") == ["young"]
    assert ids(where, "redrives") == []  # ("again"'s record went with it)
    audit = execute(where, "SELECT at_ms, cutoff_ms, status, jobs FROM asnackq_purges ORDER BY seq")
    assert [tuple(row) for row in audit] == [
        (T0 + 10, HORIZON, "done", 3),
        (T0 + 10, HORIZON, "done", 1),
    ]
    assert purge(where, HORIZON, ("done", "dead"), T0 + 11) == {"done": 0, "dead": 1}
    # a dead job goes once both its deadline and its last schedule are past the horizon;
    # pending and leased jobs never
    assert ids(where, "jobs") == ["failed-late", "held", "waiting", "young"]
    async with AsyncQueue.open(where) as queue:  # a purged id is forgotten: a new job
        assert await queue.enqueue({"id": "old-0", "qty": 7}, now_ms=T0 + 12, ttl_ms=SHORT)
    assert execute(where, "SELECT qty, status, token FROM jobs WHERE id = 'old-0'") == [
        (7, "pending", 0)
    ]


async def test_the_command_purges_and_refuses_bad_input_changing_nothing(where, capsys):
    await story(where)
    before = execute(where, "SELECT * FROM jobs ORDER BY seq")
    for bad in (
        ["--older-than", "1s"],
        ["--older-than", "7 d"],
        ["--older-than", "1d", "--batch", "0"],
    ):
        assert main(["purge", where, "--older-than", "1d", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("asnackq purge: "), err
    assert execute(where, "SELECT * FROM jobs ORDER BY seq") == before
    assert main(["purge", where, "--older-than", "1m", "--dead", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["purged"] == {"done": 5, "dead": 2}  # (the story's deadlines are long past)
    assert ids(where, "jobs") == ["held", "waiting"]


def test_the_command_creates_no_queue(tmp_path: Path, capsys):
    missing = tmp_path / "none.db"
    assert main(["purge", str(missing), "--older-than", "1d"]) == 1
    assert "no queue at" in capsys.readouterr().err and not missing.exists()


async def test_a_purged_delivery_takes_its_row_and_its_event_once_none_is_left(where):
    async with AsyncQueue.open(where) as queue:
        for name in ("a", "b"):
            endpoint = Endpoint(name, "http://127.0.0.1:9/hooks", types=("order.*",))
            await queue.add_endpoint(endpoint, now_ms=T0)
        made = await queue.publish({"id": "ev-1", "type": "order.paid", "data": {"n": 1}}, T0)
        nobody = await queue.publish({"id": "ev-none", "type": "user.made", "data": 2}, T0)
        assert nobody.created and nobody.deliveries == ()
        jobs = dict(made.deliveries)
        a = queue.in_lane(Lane("a"))
        ticket = await a.claim("w", T0, 500)
        assert ticket is not None and ticket["id"] == jobs["a"]
        assert await a.finish(ticket, "ok", T0 + 1) == "done"
    assert purge(where, HORIZON, ("done",), T0 + 10) == {"done": 1}
    assert ids(where, "asnackq_deliveries", "job") == [jobs["b"]]
    assert ids(where, "asnackq_events") == ["ev-1", "ev-none"]  # b's delivery still pending
    async with AsyncQueue.open(where) as queue:
        b = queue.in_lane(Lane("b"))
        ticket = await b.claim("w", T0 + 2, 500)
        assert ticket is not None and ticket["id"] == jobs["b"]
        assert await b.finish(ticket, "ok", T0 + 3) == "done"
    assert purge(where, HORIZON, ("done",), T0 + 11) == {"done": 1}
    assert ids(where, "asnackq_deliveries", "job") == []
    assert ids(where, "asnackq_events") == ["ev-none"]  # (no endpoint took it: it stays)


async def test_the_audit_names_a_purged_jobs_inbox_row_purged_and_a_later_orphan_a_violation(
    tmp_path: Path,
):
    queue, sink_db = tmp_path / "q.db", tmp_path / "sink.db"
    async with AsyncQueue.open(queue) as opened:
        await opened.enqueue_many([{"id": f"j{i}", "qty": i + 1} for i in range(6)])
        async with sink(sink_db) as running, AsyncHttpSender(running.url, timeout_s=5.0) as http:
            summary = await Dispatcher(opened, http, owner="w", concurrency=4).run(until_empty=True)
    assert summary.done == 6
    assert ops.audit(queue, sink_db, epoch_ms()).violations == 0
    cutoff = epoch_ms() + 1
    assert purge(queue, cutoff, ("done",), cutoff) == {"done": 6}
    audited = ops.audit(queue, sink_db, epoch_ms())
    assert audited.violations == 0 and audited.flags["purged"] == 6, audited
    assert audited.stages == {"purged": 6}
    con = sqlite3.connect(sink_db)
    with con:  # an effect the queue never asked for, after the purge's cutoff
        add_records(con, [("stray", 1, None, None, 1, cutoff + 60_000, cutoff + 60_000)])
        con.execute("UPDATE stock SET total = total + 1")
    con.close()
    audited = ops.audit(queue, sink_db, epoch_ms())
    assert audited.violations == 1 and audited.flags["orphan-inbox-row"] == 1, audited
