"""The outbox's accept takes events of any JSON value: stored by the events plan with their
deliveries in the accept's transaction (the application's own, on SQLite and PostgreSQL),
refused in one line with nothing written when bad or too large; the seed's ``{id, qty}``
outbox beside them keeps its seq order and its dispatch."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import endpoints as ep
from asnackq.core import events as ev
from asnackq.core import outbox
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint
from asnackq.lab.procs import sink_process
from asnackq.store import files
from asnackq.store.borrowed import PG_ORDERS, Source
from asnackq.store.targets import is_url

from . import pgdb
from .conftest import T0, execute
from .sequencer import until
from .sinks import sink_state
from .test_borrowed import app as an_app
from .test_borrowed import open_app
from .test_webhook_senders import SECRET, receiver, run_cli

HOOKS = Endpoint("hooks", "http://127.0.0.1:9/hooks")  # every type
PAID = Endpoint("paid", "http://127.0.0.1:9/paid", types=("order.*",))
REFUNDS = Endpoint("refunds", "http://127.0.0.1:9/refunds", types=("refund.made",))
EVENT = {"id": "e1", "type": "order.paid", "key": "customer-7", "data": {"lines": [1, 2.5, "ü"]}}
app = an_app  # the fixture ``app``: an application's connection, aiosqlite or psycopg
BIG = 256 * 1024
BAD = [
    {"id": "e9", "data": {1: "a key that is not a string"}},
    {"id": "e9", "data": {"x": float("nan")}},
    {"id": "e9", "data": {"x": object()}},
    {"id": "e 9", "data": 1},
    {"id": "e9", "data": 1, "type": "order..paid"},
    {"id": "e9", "data": 1, "type": "order paid"},
    {"id": "e9", "data": 1, "type": 7},
    {"id": "e9", "data": 1, "key": ""},
    {"id": "e9", "data": 1, "qty": 1},
    {"id": "e9", "data": "x" * BIG},  # its body is past 256 KiB
    {"id": "e9"},
    ["e9", 1],
]


@pytest.fixture
def source(tmp_path):
    con = outbox.open_source(tmp_path / "source.db")
    w.drive(con, ep.plan_add(HOOKS, T0))
    w.drive(con, ep.plan_add(PAID, T0))
    w.drive(con, ep.plan_add(REFUNDS, T0))
    yield con
    assert not con.in_transaction
    con.close()


def stored(target):
    """The events, their deliveries and the jobs, read through a separate connection."""
    return (
        execute(target, "SELECT id, type, key FROM asnackq_events ORDER BY seq"),
        execute(target, "SELECT event, endpoint, key FROM asnackq_deliveries ORDER BY job"),
        execute(target, "SELECT qty, status FROM jobs ORDER BY id"),
    )


def sized(event_id, size):
    """An untyped event whose body, accepted at ``T0``, is exactly ``size`` bytes."""
    frame = len(json.dumps({"data": "", "timestamp": ev.timestamp(T0)}, separators=(",", ":")))
    return {"id": event_id, "data": "x" * (size - frame)}


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_event_is_stored_with_a_delivery_per_endpoint_taking_its_type(source, tmp_path):
    db = tmp_path / "source.db"
    assert outbox.accept(source, EVENT, now_ms=T0) is True
    assert outbox.accept(source, {**EVENT}, now_ms=T0 + 5) is False  # the same body again
    for other in ({**EVENT, "data": {}}, {**EVENT, "key": "k2"}, {**EVENT, "type": "order.x"}):
        with pytest.raises(w.Conflict):
            outbox.accept(source, other)
    assert stored(db) == (
        [("e1", "order.paid", "customer-7")],
        [("e1", "hooks", "customer-7"), ("e1", "paid", "customer-7")],
        [(1, "pending"), (1, "pending")],
    )
    [(body,)] = execute(db, "SELECT body FROM asnackq_events")
    assert json.loads(body) == {
        "data": {"lines": [1, 2.5, "ü"]},
        "timestamp": ev.timestamp(T0),
        "type": "order.paid",
    }
    assert outbox.pending(source) == []  # an event is no outbox row: dispatch never sends it
    assert execute(db, "SELECT count(*) FROM orders") == [(0,)]


def test_any_json_value_is_data_and_an_untyped_event_goes_to_endpoints_of_every_type(source):
    for n, data in enumerate((None, 0, "text", [], [{"a": None}], True)):
        assert outbox.accept(source, {"id": f"v{n}", "data": data}) is True
        assert outbox.accept(source, {"id": f"v{n}", "data": data}) is False
    rows = source.execute("SELECT DISTINCT endpoint FROM asnackq_deliveries").fetchall()
    assert rows == [("hooks",)]


def test_a_failed_accept_writes_nothing_of_the_event(source, tmp_path):
    assert outbox.accept(source, EVENT) is True
    source.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON asnackq_deliveries WHEN NEW.endpoint = 'paid' "
        "BEGIN SELECT RAISE(ABORT, 'boom'); END"
    )
    with pytest.raises(sqlite3.IntegrityError):
        outbox.accept(source, {**EVENT, "id": "e2"})  # hooks' delivery written, then rolled back
    events, deliveries, jobs = stored(tmp_path / "source.db")
    assert events == [("e1", "order.paid", "customer-7")] and len(deliveries) == len(jobs) == 2


def test_bad_events_are_one_line_and_change_no_byte(source, tmp_path):
    outbox.accept(source, EVENT)
    before = digest(tmp_path / "source.db")
    for bad in BAD:
        with pytest.raises(ValueError) as raised:
            outbox.accept(source, bad)
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 300, bad
    for size in (0, ev.MAX_BYTES + 1, True, "1"):
        with pytest.raises(ValueError, match="max_event_bytes"):
            outbox.accept(source, {"id": "e9", "data": 1}, max_event_bytes=size)
    assert digest(tmp_path / "source.db") == before


def test_the_size_limit_is_256_kib_unless_given_and_at_most_1_mib(source):
    assert outbox.accept(source, sized("at", BIG), now_ms=T0) is True
    with pytest.raises(ValueError, match=f"is {BIG + 1} bytes, over the queue's max_event_bytes"):
        outbox.accept(source, sized("past", BIG + 1), now_ms=T0)
    mib = ev.MAX_BYTES
    assert outbox.accept(source, sized("mib", mib), now_ms=T0, max_event_bytes=mib) is True
    with pytest.raises(ValueError, match="over the queue's max_event_bytes"):
        outbox.accept(source, sized("big", mib + 1), now_ms=T0, max_event_bytes=mib)
    ids = source.execute("SELECT id, length(body) FROM asnackq_events ORDER BY seq").fetchall()
    assert ids == [("at", BIG), ("mib", mib)]


def test_orders_keep_their_seq_order_and_dispatch_beside_events(source):
    outbox.accept(source, {"id": "b", "qty": 2})
    outbox.accept(source, {**EVENT, "id": "a"})
    outbox.accept(source, {"id": "a", "qty": 1})  # an order may share an event's id
    sent = []
    assert outbox.dispatch(source, lambda item: sent.append(item) or True) == ["b", "a"]
    assert sent == [{"id": "b", "qty": 2}, {"id": "a", "qty": 1}]
    jobs = source.execute("SELECT status FROM jobs").fetchall()
    assert jobs == [("pending",), ("pending",)]  # the event's deliveries: the worker's


async def test_a_source_db_is_a_queue_whose_endpoints_and_worker_open_it(tmp_path):
    path = tmp_path / "fresh.db"
    outbox.open_source(path).close()
    assert files.holds(path, w.SCHEMA) and files.holds(path, outbox.SOURCE_SCHEMA)
    async with AsyncQueue.open(path) as queue:  # the worker's (and ``endpoint add``'s) view
        await queue.add_endpoint(HOOKS, now_ms=T0)
        con = outbox.open_source(path)
        try:
            assert outbox.accept(con, EVENT, now_ms=T0) is True
        finally:
            con.close()
        [(job_id,)] = execute(path, "SELECT job FROM asnackq_deliveries")
        event_id, body = await queue.delivery(job_id)
    assert event_id == "e1" and json.loads(body)["data"] == EVENT["data"]


@pytest.mark.process
@pytest.mark.timeout(300)  # (a dozen CLI processes: on a busy machine, minutes)
def test_the_commands_accept_orders_and_events_and_each_leaves_its_own_way(tmp_path):
    source = tmp_path / "source.db"

    def accept(*args):
        return run_cli("outbox", "accept", str(source), *args)

    assert json.loads(accept("--id", "o1", "--qty", "2").stdout)["accepted"] is True
    (tmp_path / "secret").write_text(SECRET)
    with receiver() as hooks:
        secret = ("--secret-file", str(tmp_path / "secret"))
        added = run_cli("endpoint", "add", str(source), "hooks", "--url", hooks.url, *secret)
        assert added.returncode == 0, added.stderr
        event = ("--id", "e1", "--type", "order.paid", "--key", "c-7", "--data", '{"n": [1]}')
        assert json.loads(accept(*event).stdout)["accepted"] is True
        assert json.loads(accept(*event).stdout)["accepted"] is False
        before = digest(source)
        for refused, says in (
            ((*event[:-1], '{"n": 2}'), "exists with another type, key or data"),
            (("--id", "e2", "--type", "order..paid", "--data", "1"), "an event type is dotted"),
            (("--id", "e2", "--data", '"' + "x" * 99 + '"', "--max-event-bytes", "50"), "over"),
            (("--id", "e2", "--data", "1", "--max-event-bytes", str(ev.MAX_BYTES + 1)), "1..1"),
            (("--id", "e2", "--data", "{"), "--data:"),
            (("--id", "e2", "--data", "1", "--qty", "1"), "--qty (an order) or --data"),
        ):
            said = accept(*refused)
            assert said.returncode in (1, 2) and said.stderr.count("\n") == 1, said.stderr
            assert says in said.stderr
        assert digest(source) == before
        done = run_cli("work", str(source), "--endpoint", "hooks", "--until-empty", "--json")
        assert done.returncode == 0, done.stderr
        assert [seen["webhook-id"] for seen in hooks.seen] == ["e1"] and hooks.refused == 0
    with sink_process(tmp_path / "sink.db") as url:
        sent = run_cli("outbox", "dispatch", str(source), "--sink", url)
    assert json.loads(sent.stdout) == {"sent": ["o1"]}  # the orders alone, in seq order
    assert sink_state(tmp_path / "sink.db") == (2, [("o1", 2, 1)])


# --- inside the application's transaction, on SQLite and PostgreSQL ----------------------


@pytest.fixture
async def app_source(app):
    source = await Source.within(app.con)
    async with AsyncQueue.open(app.target) as queue:  # a queue's own connection adds them
        for endpoint in (HOOKS, PAID, REFUNDS):
            await queue.add_endpoint(endpoint, now_ms=T0)
    await app.begin()
    assert await source.accept({"id": "e0", "data": "first"}, T0) is True
    await app.commit()
    return source


@pytest.mark.process
@pytest.mark.parametrize("end", ["commit", "rollback"])
async def test_the_event_and_its_deliveries_commit_with_the_application(app, app_source, end):
    await app.begin()
    await app.order("o1", 3)
    assert await app_source.accept(EVENT, T0) is True
    assert await app_source.accept(EVENT, T0 + 1) is False
    with pytest.raises(w.Conflict):  # its savepoint rolled back: the transaction goes on
        await app_source.accept({**EVENT, "data": [1]}, T0)
    assert stored(app.target)[0] == [("e0", None, None)]  # nothing before the COMMIT
    await getattr(app, end)()
    events, deliveries, jobs = stored(app.target)
    if end == "commit":
        assert app.orders() == [("o1", 3)]
        assert events == [("e0", None, None), ("e1", "order.paid", "customer-7")]
        assert deliveries[1:] == [("e1", "hooks", "customer-7"), ("e1", "paid", "customer-7")]
        assert jobs == [(1, "pending")] * 3
    else:
        assert app.orders() == [] and events == [("e0", None, None)]
        assert deliveries == [("e0", "hooks", None)] and jobs == [(1, "pending")]


@pytest.mark.process
async def test_bad_events_in_the_application_transaction_are_one_line_and_write_nothing(
    app, app_source
):
    await app.begin()
    await app.order("o1", 3)
    refused = [*BAD, *([] if app.sqlite else [{"id": "o2", "qty": 1}])]
    for bad in refused:
        with pytest.raises(ValueError) as raised:
            await app_source.accept(bad, T0)
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 300, bad
    await app.commit()
    assert app.orders() == [("o1", 3)]
    assert stored(app.target)[0] == [("e0", None, None)]
    if not is_url(app.target):
        assert execute(app.target, "SELECT count(*) FROM outbox") == [(0,)]


@pytest.mark.process
async def test_on_postgresql_the_outbox_takes_events_and_refuses_orders(app, app_source):
    if app.sqlite:
        await app.begin()
        assert await app_source.accept({"id": "o1", "qty": 2}) is True  # the seed's outbox
        await app.commit()
        assert execute(app.target, "SELECT id, qty, sent FROM outbox") == [("o1", 2, 0)]
        return
    await app.begin()
    with pytest.raises(ValueError, match="need a SQLite source DB") as raised:
        await app_source.accept({"id": "o1", "qty": 2})
    assert str(raised.value) == PG_ORDERS
    await app.rollback()


@pytest.mark.process
async def test_a_source_stores_bodies_up_to_its_limit_and_refuses_one_byte_more(app):
    default = await Source.within(app.con)
    widest = await Source.within(app.con, max_event_bytes=ev.MAX_BYTES)
    await app.begin()
    assert await default.accept(sized("at", BIG), T0) is True
    with pytest.raises(ValueError, match="over the queue's max_event_bytes"):
        await default.accept(sized("past", BIG + 1), T0)
    assert await widest.accept(sized("mib", ev.MAX_BYTES), T0) is True
    with pytest.raises(ValueError, match="over the queue's max_event_bytes"):
        await widest.accept(sized("big", ev.MAX_BYTES + 1), T0)
    await app.commit()
    sizes = execute(app.target, "SELECT id, length(body) FROM asnackq_events ORDER BY seq")
    assert sizes == [("at", BIG), ("mib", ev.MAX_BYTES)]


def waiting_for_a_lock(url):
    """Whether a session of this database waits for a lock another transaction holds."""
    rows = pgdb.query(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'",
    )
    return rows[0][0] > 0


@pytest.mark.process
@pytest.mark.parametrize("body", ["same", "other"])
async def test_two_applications_accepting_one_event_at_once_on_postgresql(pg_db, body):
    url = pg_db()
    first, second = await open_app(url), await open_app(url)
    try:
        one, two = await Source.within(first.con), await Source.within(second.con)
        await first.begin()
        assert await one.accept({"id": "e0", "data": 0}, T0) is True  # the tables, committed
        await first.commit()
        await first.begin()
        await second.begin()
        assert await one.accept(EVENT, T0) is True
        racing = asyncio.ensure_future(
            two.accept(EVENT if body == "same" else {**EVENT, "data": 2}, T0)
        )
        await until(lambda: waiting_for_a_lock(url), 30)  # on the first's new row
        await first.commit()
        if body == "same":  # its savepoint rolled back, its plan made again: it reads e1
            assert await asyncio.wait_for(racing, 30) is False
        else:
            with pytest.raises(w.Conflict):
                await asyncio.wait_for(racing, 30)
        await second.commit()
    finally:
        await first.con.close()
        await second.con.close()
    assert stored(url)[0] == [("e0", None, None), ("e1", "order.paid", "customer-7")]
