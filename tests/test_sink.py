"""The HTTP sink on a real loopback port: effects once, bad input refused, faults injected."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import subprocess

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asnackq.core.worker import Permanent, Retryable
from asnackq.http_sink import CONFIG, INBOX
from asnackq.lab.procs import command, start_sink, stop
from asnackq.sink.stock import StockInbox, open_sink_db
from asnackq.wire.send import AsyncHttpSender, HttpSender

from .pgdb import query
from .sinks import sink, sink_state
from .test_aio_hops import Counting, awaits
from .test_cli import fails


@pytest.fixture
def sink_db(tmp_path):
    return tmp_path / "sink.db"


async def post(url, body, *, content_type="application/json", headers=None):
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url, data=body, headers={"Content-Type": content_type, **(headers or {})}
        ) as r,
    ):
        return r.status, await r.text()


async def test_applied_duplicate_conflict_and_the_stock(sink_db):
    async with sink(sink_db) as s:
        assert await post(s.url, b'{"id": "a", "qty": 3}') == (
            200,
            json.dumps({"id": "a", "status": "applied"}),
        )
        assert (await post(s.url, b'{"id": "a", "qty": 3}'))[0] == 200
        status, text = await post(s.url, b'{"id": "a", "qty": 4}')
        assert (status, json.loads(text)) == (409, {"id": "a", "status": "conflict"})
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{s.base}/stats") as r:
                stats = await r.json()
            async with session.get(f"{s.base}/events/a") as r:
                record = await r.json()
            async with session.get(f"{s.base}/events/zz") as r:
                assert r.status == 404
            async with session.get(f"{s.base}/metrics") as r:
                metrics = await r.text()
    assert sink_state(sink_db) == (3, [("a", 3, 2)])
    assert {k: stats[k] for k in ("requests", "applied", "duplicates", "conflicts", "stock")} == {
        "requests": 3,
        "applied": 1,
        "duplicates": 1,
        "conflicts": 1,
        "stock": 3,
    }
    assert record["qty"] == 3 and record["deliveries"] == 2
    assert "asnackq_sink_stock 3" in metrics.splitlines()


async def test_the_lease_token_is_recorded_first_and_last(sink_db):
    async with sink(sink_db) as s, AsyncHttpSender(s.url) as send:
        assert await send({"id": "a", "qty": 1}, token=1) is True
        assert await send({"id": "a", "qty": 1}) is True
        assert await send({"id": "a", "qty": 1}, token=3) is True
        async with aiohttp.ClientSession() as session, session.get(f"{s.base}/events/a") as r:
            record = await r.json()
    assert (record["first_token"], record["last_token"], record["deliveries"]) == (1, 3, 3)


BAD_BODIES = [
    b"",
    b"not json",
    b"[1, 2]",
    b'"a"',
    b"null",
    b'{"id": "a"}',
    b'{"qty": 1}',
    b'{"id": "a", "qty": 1, "x": 0}',
    b'{"id": "a b", "qty": 1}',
    b'{"id": "", "qty": 1}',
    b'{"id": "a", "qty": true}',
    b'{"id": "a", "qty": 1.0}',
    b'{"id": "a", "qty": 0}',
    b'{"id": "a", "qty": 1001}',
    b'{"id": "a", "qty": "1"}',
    b'{"id": 5, "qty": 1}',
    b'{"id": "a", "qty": NaN}',
    b"\xff\xfe",
    b"[" * 100_000,
    b'{"id": "\\u00e9", "qty": 1}',
]


@pytest.mark.parametrize("body", BAD_BODIES)
async def test_malformed_bodies_are_400_and_change_nothing(sink_db, body):
    async with sink(sink_db) as s:
        status, _ = await post(s.url, body[:4096])
    assert status == 400
    assert sink_state(sink_db) == (0, [])


@pytest.mark.parametrize(
    ("request_kwargs", "expected"),
    [
        ({"body": b'{"id": "a", "qty": 1}', "content_type": "text/plain"}, 415),
        (
            {"body": b'{"id": "a", "qty": 1}', "content_type": "application/x-www-form-urlencoded"},
            415,
        ),
        ({"body": b'{"id": "a", "qty": 1, "pad": "' + b"x" * 5000 + b'"}'}, 413),
        ({"body": b'{"id": "a", "qty": 1}', "headers": {"X-Asnackq-Token": "0"}}, 400),
        ({"body": b'{"id": "a", "qty": 1}', "headers": {"X-Asnackq-Token": "-1"}}, 400),
        ({"body": b'{"id": "a", "qty": 1}', "headers": {"X-Asnackq-Token": "1.5"}}, 400),
        (
            {"body": b'{"id": "a", "qty": 1}', "headers": {"X-Asnackq-Token": "1000000000000001"}},
            400,
        ),
    ],
)
async def test_wrong_type_size_or_token_is_refused(sink_db, request_kwargs, expected):
    async with sink(sink_db) as s:
        status, _ = await post(s.url, request_kwargs.pop("body"), **request_kwargs)
    assert status == expected
    assert sink_state(sink_db) == (0, [])


async def test_unknown_routes_and_methods(sink_db):
    async with sink(sink_db) as s, aiohttp.ClientSession() as session:
        async with session.get(f"{s.base}/nowhere") as r:
            assert r.status == 404
        async with session.put(s.url, json={"id": "a", "qty": 1}) as r:
            assert r.status == 405


async def test_shared_token_is_required_when_configured(sink_db):
    async with sink(sink_db, auth_token="s3cret") as s:
        assert (await post(s.url, b'{"id": "a", "qty": 1}'))[0] == 401
        assert (
            await post(s.url, b'{"id": "a", "qty": 1}', headers={"Authorization": "Bearer wrong"})
        )[0] == 401
        assert (
            await post(s.url, b'{"id": "a", "qty": 1}', headers={"Authorization": "Bearer s3cret"})
        )[0] == 200
    assert sink_state(sink_db) == (1, [("a", 1, 1)])


async def test_fail_rate_answers_503_before_any_change(sink_db):
    async with sink(sink_db, fail_rate=1.0) as s, AsyncHttpSender(s.url) as send:
        with pytest.raises(Retryable):
            await send({"id": "a", "qty": 2})
    assert sink_state(sink_db) == (0, [])


@pytest.mark.parametrize("sync", [True, False])
async def test_a_lost_ack_after_commit_is_retryable_and_a_resend_is_a_duplicate(sink_db, sync):
    async with sink(sink_db, drop_rate=1.0) as s, AsyncHttpSender(s.url) as asend:

        async def send(event):
            if sync:
                return await asyncio.to_thread(HttpSender(s.url), event)
            return await asend(event)

        with pytest.raises(Retryable):
            await send({"id": "a", "qty": 5})
        assert sink_state(sink_db) == (5, [("a", 5, 1)])  # the effect was committed
        s.app[CONFIG].drop_rate = 0.0
        assert await send({"id": "a", "qty": 5}) is True
    assert sink_state(sink_db) == (5, [("a", 5, 2)])


async def test_delay_is_applied(sink_db):
    async with sink(sink_db, delay_ms=200) as s, AsyncHttpSender(s.url, timeout_s=0.05) as send:
        with pytest.raises(Retryable):
            await send({"id": "a", "qty": 1})


async def test_the_inbox_survives_a_restart(sink_db):
    async with sink(sink_db) as s, AsyncHttpSender(s.url) as send:
        assert await send({"id": "a", "qty": 4}) is True
    async with sink(sink_db) as s:
        status, text = await post(s.url, b'{"id": "a", "qty": 4}')
    assert (status, json.loads(text)["status"]) == (200, "duplicate")
    assert sink_state(sink_db) == (4, [("a", 4, 2)])


async def test_64_concurrent_senders_200_ids_with_repeats(sink_db):
    rng = random.Random(7)
    qty = {f"id-{i}": rng.randint(1, 1000) for i in range(200)}
    deliveries = [i for i in qty for _ in range(rng.randint(1, 3))]
    rng.shuffle(deliveries)
    async with sink(sink_db) as s, AsyncHttpSender(s.url) as send:
        queue = list(deliveries)

        async def sender():
            while queue:
                event_id = queue.pop()
                assert await send({"id": event_id, "qty": qty[event_id]}) is True

        await asyncio.gather(*(sender() for _ in range(64)))
        commits = s.app[INBOX].commits
    total, inbox = sink_state(sink_db)
    assert total == sum(qty.values())
    assert len(inbox) == 200
    assert sum(row[2] for row in inbox) == len(deliveries)
    assert commits < len(deliveries)  # group commit took several per transaction


async def test_group_commit_decides_each_request_in_arrival_order(sink_db):
    inbox = StockInbox(await open_sink_db(sink_db), batch_max=100)
    try:
        pending = [
            asyncio.ensure_future(inbox.submit(i, q, None))
            for i, q in [("a", 1), ("a", 1), ("a", 2), ("b", 3)]
        ]  # (all four wait in line before the batch's task takes them)
        assert await asyncio.gather(*pending) == ["applied", "duplicate", "conflict", "applied"]
        assert inbox.commits == 1
    finally:
        await inbox.close()
    assert sink_state(sink_db) == (4, [("a", 1, 2), ("b", 3, 1)])


async def test_a_failed_batch_answers_503_to_each_request_and_changes_nothing(sink_db):
    await (await open_sink_db(sink_db)).close()
    con = sqlite3.connect(sink_db)
    con.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON asnackq_webhook_inbox WHEN NEW.id = 'boom' "
        "BEGIN SELECT RAISE(ABORT, 'boom'); END"
    )
    con.close()
    async with sink(sink_db) as s:
        results = await asyncio.gather(
            *(post(s.url, json.dumps({"id": i, "qty": 1}).encode()) for i in ("x", "boom", "y"))
        )
        assert results[1][0] == 503
        assert (await post(s.url, b'{"id": "z", "qty": 1}'))[0] == 200
    total, inbox = sink_state(sink_db)
    # Whatever shared the failing batch got 503 and left no trace; the rest is consistent.
    applied = {row[0] for row in inbox}
    assert "boom" not in applied and "z" in applied
    for event_id, (status, _) in zip(("x", "y"), (results[0], results[2]), strict=True):
        assert (status == 200) == (event_id in applied)
    assert total == len(applied)


async def test_the_same_id_and_qty_in_other_whitespace_is_a_duplicate(sink_db):
    bodies = [b'{"id": "w", "qty": 2}', b'{ "qty":2,\n  "id":"w" }', b'{"qty": 3, "id": "w"}']
    async with sink(sink_db) as s:
        found = [await post(s.url, body) for body in bodies]
    assert [(status, json.loads(text)["status"]) for status, text in found] == [
        (200, "applied"),
        (200, "duplicate"),
        (409, "conflict"),
    ]
    assert sink_state(sink_db) == (2, [("w", 2, 2)])


async def test_a_batch_on_the_sinks_file_begins_with_its_first_write(sink_db):
    """New ids: the rows' INSERT (BEGIN rides with it), the moves with the stock (sent at
    once), COMMIT; with repeats, the read of the rows that were there and their count:
    whatever the size."""
    inbox = StockInbox(await open_sink_db(sink_db), batch_max=1000)
    counting = Counting(inbox.db.db)
    inbox.db.db = counting
    try:
        hops = []
        for size in (1, 300):
            new = [(f"n{size}-{i}", 1) for i in range(size)]
            old = [(f"o{size}-{i}", 1) for i in range(size)]
            _, first = await awaits(counting, submit_all(inbox, old))
            found, then = await awaits(counting, submit_all(inbox, new + old))
            assert found == ["applied"] * size + ["duplicate"] * size
            hops.append((first, then))
    finally:
        await inbox.close()
    assert hops == [(3, 5), (3, 5)]
    assert sink_state(sink_db)[0] == 2 * (1 + 300)


async def test_a_file_held_by_another_writer_is_503_then_the_sink_commits_once_free(sink_db):
    async with sink(sink_db) as s:
        holder = sqlite3.connect(sink_db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # held past the sink's busy timeout
        try:
            held = await post(s.url, b'{"id": "h", "qty": 1}')
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert held == (503, json.dumps({"id": "h", "status": "unavailable"}))
        assert (await post(s.url, b'{"id": "h", "qty": 1}'))[0] == 200
        assert s.app[INBOX].health()["db_outages"] == 1
    assert sink_state(sink_db) == (1, [("h", 1, 1)])


async def submit_all(inbox, events):
    """Each event's status, all submitted at once (one batch)."""
    return await asyncio.gather(*(inbox.submit(i, qty, None) for i, qty in events))


EARLIER = """CREATE TABLE inbox (id TEXT PRIMARY KEY, qty INTEGER NOT NULL, first_token INTEGER,
  last_token INTEGER, deliveries INTEGER NOT NULL, applied_at_ms INTEGER NOT NULL,
  last_seen_ms INTEGER NOT NULL);
CREATE TABLE stock (one INTEGER PRIMARY KEY CHECK (one = 1), total INTEGER NOT NULL);
INSERT INTO stock VALUES (1, 3);
INSERT INTO inbox VALUES ('a', 3, 1, 1, 1, 0, 0);"""


def earlier_sink(path):
    """A sink DB as an earlier asnackq left it: its own inbox table, one event applied."""
    con = sqlite3.connect(path)
    con.executescript(EARLIER)
    con.close()
    return path


async def test_a_db_holding_an_earlier_sinks_inbox_is_refused_and_left_as_it_was(tmp_path):
    db = earlier_sink(tmp_path / "old.db")
    before = db.read_bytes()
    with pytest.raises(ValueError, match=r"old.db holds the inbox of an earlier asnackq sink"):
        await open_sink_db(db)
    assert db.read_bytes() == before and sorted(tmp_path.iterdir()) == [db]


@pytest.mark.process
def test_the_sink_command_refuses_an_earlier_sinks_inbox_in_one_line(tmp_path):
    db = earlier_sink(tmp_path / "old.db")
    said = fails("sink", "--db", db, "--port", "0")
    assert "holds the inbox of an earlier asnackq sink" in said and "new --db" in said


@pytest.mark.process
async def test_a_postgresql_db_holding_an_earlier_sinks_inbox_is_refused(pg_db):
    url = pg_db()
    query(url, EARLIER.replace(";\n", ";"))
    query(url, "CREATE TABLE asnackq_schema (part TEXT PRIMARY KEY, version INTEGER NOT NULL)")
    query(url, "INSERT INTO asnackq_schema VALUES ('sink', 1)")
    with pytest.raises(ValueError, match=r"holds the inbox of an earlier asnackq sink"):
        await open_sink_db(url)
    assert query(url, "SELECT id, qty FROM inbox") == [("a", 3)]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda v: json.dumps(v).encode(),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                lambda inner: (
                    st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["id", "qty", "x"]), inner, max_size=3)
                ),
            ),
        ),
    ),
    token=st.one_of(st.none(), st.text(max_size=20)),
    content_type=st.sampled_from(["application/json", "text/plain", ""]),
)
def test_fuzzed_requests_never_get_a_500_and_keep_the_stock_consistent(
    tmp_path_factory, body, token, content_type
):
    db = tmp_path_factory.mktemp("fuzz") / "sink.db"
    headers = (
        {}
        if token is None or not token.isprintable() or not token.isascii()
        else {"X-Asnackq-Token": token}
    )

    async def scenario():
        async with sink(db) as s:
            return await post(s.url, body, content_type=content_type, headers=headers)

    status, _ = asyncio.run(scenario())
    assert status < 500
    total, inbox = sink_state(db)
    assert total == sum(row[1] for row in inbox)
    assert (status == 200) == (len(inbox) == 1)


@pytest.mark.process
def test_sink_command_prints_its_address_and_stops_cleanly_on_sigterm(tmp_path):
    proc, url = start_sink(tmp_path / "s.db")  # its first line: "... listening on URL"
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/events")
        assert HttpSender(url)({"id": "a", "qty": 2}) is True
    finally:
        assert stop(proc, timeout_s=20) == [0]  # SIGTERM: a clean stop
    assert sink_state(tmp_path / "s.db") == (2, [("a", 2, 1)])


@pytest.mark.process
def test_sink_command_refuses_a_non_loopback_host_without_the_flag(tmp_path):
    run = subprocess.run(
        command("sink", "--db", tmp_path / "s.db", "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "--allow-remote" in run.stderr
    assert not (tmp_path / "s.db").exists()


def test_permanent_is_not_retryable():
    assert not issubclass(Permanent, Retryable)
