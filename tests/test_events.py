"""Events of any JSON value: their intake and fan-out on a file and on PostgreSQL - the
stored body, the deliveries per endpoint in the intake's transaction, duplicates and
conflicts, the size limit's edges, ``to=``, disabled and later endpoints, mixed intakes,
and refusals that write nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import events as ev
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import Delays, Endpoint, Exponential, NoSuchEndpoint
from asnackq.store.targets import is_url

from .conftest import T0, execute
from .test_endpoints import where as a_queue

URL = "http://127.0.0.1:9/hooks"
where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
ORDER = {"id": "ev-1", "type": "order.created", "key": "cust-7", "data": {"total": 12, "n": [1]}}


def state(where: str) -> list[Any]:
    """The jobs, events and deliveries, read through a separate connection."""
    found: list[Any] = [*execute(where, "SELECT id, qty, status, max_attempts FROM jobs")]
    for table, columns in (("asnackq_events", "id, type, key"), ("asnackq_deliveries", "*")):
        present = (
            execute(where, f"SELECT to_regclass('{table}') IS NOT NULL")[0][0]
            if is_url(where)
            else execute(where, f"SELECT count(*) FROM sqlite_master WHERE name = '{table}'")[0][0]
        )
        if present:
            found += [table, *sorted(execute(where, f"SELECT {columns} FROM {table}"))]
    return sorted(found, key=repr)


def body(where: str, event_id: str) -> bytes:
    mark = "%s" if is_url(where) else "?"
    sql = f"SELECT body FROM asnackq_events WHERE id = '{event_id}'".replace("?", mark)
    return bytes(execute(where, sql)[0][0])


async def endpoints(queue: AsyncQueue, *added: Endpoint) -> None:
    for endpoint in added:
        await queue.add_endpoint(endpoint, now_ms=T0)


async def test_an_event_fans_out_to_each_endpoint_taking_its_type(where: str) -> None:
    async with AsyncQueue.open(where, ttl_ms=60_000, max_attempts=4) as queue:
        await endpoints(
            queue,
            Endpoint("orders", URL, types=("order.*",)),
            Endpoint("all", URL, retry=Delays((0, 1000, 2000))),
            Endpoint("refunds", URL, types=("refund.done",), retry=Exponential(10, 100)),
        )
        made = await queue.publish(ORDER, T0)
        other = await queue.publish({"id": "ev-2", "type": "refund.done", "data": None}, T0 + 1)
    assert made.created and [name for name, _ in made.deliveries] == ["all", "orders"]
    assert [name for name, _ in other.deliveries] == ["all", "refunds"]
    jobs = {row[0]: row for row in execute(where, "SELECT id, qty, status, max_attempts FROM jobs")}
    assert jobs[made.deliveries[0][1]] == (made.deliveries[0][1], 1, "pending", 4)  # 3 delays + 1
    assert jobs[made.deliveries[1][1]][3] == 9  # the default 8 delays
    assert jobs[other.deliveries[1][1]][3] == 4  # exponential: the queue's budget
    assert all(job.startswith(lanes.lane_of(name) + "-") for name, job in made.deliveries)
    first, second = made.deliveries[0][1], other.deliveries[0][1]
    assert first < second  # within a lane, ids sort in enqueue order
    sent = json.loads(body(where, "ev-1"))
    assert sent == {"type": "order.created", "timestamp": ev.timestamp(T0), "data": ORDER["data"]}
    assert body(where, "ev-1") == json.dumps(sent, sort_keys=True, separators=(",", ":")).encode()
    rows = execute(where, "SELECT job, event, endpoint, key FROM asnackq_deliveries")
    assert sorted(rows)[0][1:] == ("ev-1", "all", "cust-7")


async def test_the_same_event_again_is_a_no_op_and_another_body_a_conflict(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        await endpoints(queue, Endpoint("all", URL))
        assert await queue.enqueue(ORDER, T0) is True
        before = state(where)
        reordered = {**ORDER, "data": {"n": [1], "total": 12}}  # the same JSON value
        assert await queue.enqueue(reordered, T0 + 5000) is False
        again = await queue.publish(ORDER, T0 + 9000)
        assert (again.created, again.deliveries) == (False, ())
        for changed in ({"data": {"total": 13, "n": [1]}}, {"type": "order.paid"}, {"key": "x"}):
            with pytest.raises(w.Conflict, match="ev-1"):
                await queue.enqueue({**ORDER, **changed}, T0)
        many = await queue.enqueue_many([ORDER, {**ORDER, "data": 1}], T0)
    assert many[0] is False and isinstance(many[1], w.Conflict)
    assert state(where) == before


async def test_the_size_limit_takes_exactly_the_limit_and_refuses_one_byte_more(
    where: str,
) -> None:
    event = {"id": "big", "type": "blob.put", "data": "x" * 5000}
    size = len(ev.check_event(event, T0, ev.MAX_BYTES).body)
    async with AsyncQueue.open(where, max_event_bytes=size - 1) as queue:
        await endpoints(queue, Endpoint("all", URL))
        before = state(where)
        with pytest.raises(ValueError, match=f"{size} bytes, over the queue's max_event_bytes"):
            await queue.publish(event, T0)
        with pytest.raises(ValueError, match="max_event_bytes"):
            await queue.enqueue_many([{"id": "fine", "qty": 1}, event], T0)
        assert state(where) == before  # nothing written, the plain event neither
    async with AsyncQueue.open(where, max_event_bytes=size) as queue:
        assert (await queue.publish(event, T0)).created
    assert len(body(where, "big")) == size


@pytest.mark.parametrize("limit", [0, ev.MAX_BYTES + 1, True, 1.5])
async def test_a_size_limit_out_of_range_is_refused_at_open(tmp_path: Path, limit: Any) -> None:
    with pytest.raises(ValueError, match="max_event_bytes"):
        await AsyncQueue.connect(tmp_path / "q.db", max_event_bytes=limit)
    assert not (tmp_path / "q.db").exists()


async def test_to_names_the_endpoints_and_an_unknown_name_writes_nothing(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        await endpoints(queue, Endpoint("a", URL, types=("x.y",)), Endpoint("b", URL))
        made = await queue.publish({"id": "e", "type": "other", "data": 1}, T0, to=["a"])
        assert [name for name, _ in made.deliveries] == ["a"]  # to= routes, types do not
        before = state(where)
        with pytest.raises(NoSuchEndpoint, match="nobody"):
            await queue.publish({"id": "f", "data": 1}, T0, to=["b", "nobody"])
        for bad in ([], ["a", "a"], ["bad name"], "a"):
            with pytest.raises(ValueError, match="to"):
                await queue.publish({"id": "f", "data": 1}, T0, to=bad)
        with pytest.raises(ValueError, match="to names endpoints"):
            await queue.enqueue({"id": "p", "qty": 1}, T0, to=["a"])
        assert state(where) == before


async def test_disabled_endpoints_get_none_later_ones_only_what_follows(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        nobody = await queue.publish({"id": "e0", "data": [1]}, T0)
        await endpoints(queue, Endpoint("a", URL), Endpoint("b", URL))
        await queue.disable_endpoint("b", "paused", now_ms=T0)
        first = await queue.publish({"id": "e1", "data": [1]}, T0)
        named = await queue.publish({"id": "e2", "data": [1]}, T0, to=["b"])
        await endpoints(queue, Endpoint("c", URL))
        await queue.enable_endpoint("b", now_ms=T0)
        last = await queue.publish({"id": "e3", "data": [1]}, T0)
    assert (nobody.created, nobody.deliveries) == (True, ())  # stored, no delivery
    assert [name for name, _ in first.deliveries] == ["a"]
    assert named.deliveries == ()  # a disabled endpoint gets none, even named
    assert [name for name, _ in last.deliveries] == ["a", "b", "c"]
    endpoints_of = execute(where, "SELECT DISTINCT event FROM asnackq_deliveries")
    assert sorted(row[0] for row in endpoints_of) == ["e1", "e3"]


async def test_a_mixed_intake_keeps_the_contracts_events_exact(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        await endpoints(queue, Endpoint("a", URL))
        found = await queue.enqueue_many(
            [{"id": "p1", "qty": 3}, {"id": "e1", "data": {}}, ({"id": "p2", "qty": 9}, 5000, 2)],
            T0,
        )
        assert found == [True, True, True]
        assert await queue.enqueue_many([{"id": "p1", "qty": 3}], T0) == [False]
    p2 = execute(
        where, "SELECT qty, status, attempts, max_attempts, deadline FROM jobs WHERE id = 'p2'"
    )
    assert p2 == [(9, "pending", 0, 2, T0 + 5000)]
    assert sorted(r[0] for r in execute(where, "SELECT event FROM asnackq_deliveries")) == ["e1"]


CYCLE: list[Any] = [1]
CYCLE.append(CYCLE)


@pytest.mark.parametrize(
    ("event", "says"),
    [
        ({"id": "e", "data": float("nan")}, "data is not JSON"),
        ({"id": "e", "data": {1j: 2}}, "data is not JSON"),
        ({"id": "e", "data": [{"a": {1: 2}}]}, "an object key is not a string"),
        ({"id": "e", "data": object()}, "data is not JSON"),
        ({"id": "e", "data": CYCLE}, "data is not JSON"),
        # what every asnackq receiver refuses (asnackq.wire.strict_json) is never sent
        ({"id": "e", "data": {"s": "\ud800"}}, "event 'e': data is not JSON: .*surrogate"),
        ({"id": "e", "data": [10**30]}, "event 'e': data is not JSON: an integer of more than 30"),
        ({"id": "e", "data": -(10**40)}, "event 'e': data is not JSON: an integer of more than 30"),
        ({"id": "e", "type": "order..x", "data": 1}, "an event type"),
        ({"id": "e", "type": "order.*", "data": 1}, "an event type"),
        ({"id": "e", "key": "", "data": 1}, "an event key"),
        ({"id": "e", "key": "a\nb", "data": 1}, "an event key"),
        ({"id": "e x", "data": 1}, "event id"),
        ({"id": "e", "data": 1, "qty": 1}, "an event is a dict"),
        ({"id": "e", "data": 1, "to": ["a"]}, "an event is a dict"),
    ],
)
async def test_bad_events_are_one_line_refusals_that_write_nothing(
    tmp_path: Path, event: dict[str, Any], says: str
) -> None:
    where = str(tmp_path / "q.db")
    async with AsyncQueue.open(where) as queue:
        await endpoints(queue, Endpoint("a", URL))
        before = state(where)
        with pytest.raises(ValueError, match=says) as refused:
            await queue.enqueue_many([{"id": "ok", "qty": 1}, event], T0)
    assert "\n" not in str(refused.value)
    assert state(where) == before


async def test_a_rolled_back_application_transaction_keeps_no_event_and_no_delivery(
    where: str,
) -> None:
    from .test_borrowed import open_app

    async with AsyncQueue.open(where) as queue:
        await endpoints(queue, Endpoint("a", URL))
    app = await open_app(where)
    try:
        queue = await AsyncQueue.within(app.con)
        await app.begin()
        await app.order("o1", 1)
        assert (await queue.publish({"id": "e1", "data": {"order": "o1"}}, T0)).deliveries
        await app.rollback()
        assert state(where) == []  # no event, no delivery, no job (and no table either)
        await app.begin()
        await app.order("o2", 1)
        made = await queue.publish({"id": "e2", "data": {"order": "o2"}}, T0)
        await app.commit()
    finally:
        await app.con.close()
    assert app.orders() == [("o2", 1)]
    assert [row[0] for row in execute(where, "SELECT event FROM asnackq_deliveries")] == ["e2"]
    assert [row[0] for row in execute(where, "SELECT id FROM jobs")] == [made.deliveries[0][1]]


# --- the command line ---------------------------------------------------------------------


@pytest.mark.process
def test_enqueue_takes_events_and_jobs_from_json_lines_and_options(tmp_path: Path) -> None:
    from .test_webhook_senders import run_cli

    db = str(tmp_path / "q.db")

    async def setup() -> None:
        async with AsyncQueue.open(db) as queue:
            await endpoints(queue, Endpoint("a", URL, types=("order.*",)), Endpoint("b", URL))

    asyncio.run(setup())
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        '{"id": "j1", "qty": 2}\n'
        '{"id": "e1", "type": "order.paid", "key": "k", "data": {"x": [1, null]}}\n'
        '{"id": "e2", "type": "user.new", "data": "hi", "max_attempts": 3}\n'
    )
    first = run_cli("enqueue", db, str(lines), "--json")
    one = run_cli("enqueue", db, "--id", "e3", "--data", "[1]", "--type", "x.y", "--to", "a")
    again = run_cli("enqueue", db, str(lines), "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["inserted"] == 3 and one.returncode == 0, one.stderr
    assert json.loads(again.stdout)["present"] == 3
    rows = execute(db, "SELECT event, endpoint FROM asnackq_deliveries ORDER BY event, endpoint")
    assert rows == [("e1", "a"), ("e1", "b"), ("e2", "b"), ("e3", "a")]
    assert execute(db, "SELECT qty FROM jobs WHERE id = 'j1'") == [(2,)]


@pytest.mark.process
@pytest.mark.parametrize(
    ("line", "options", "says"),
    [
        ('{"id": "e", "data": NaN}', [], "NaN is not JSON"),
        ('{"id": "e", "data": 1, "qty": 1}', [], "unknown keys ['qty']"),
        ('{"id": "e", "type": "a b", "data": 1}', [], "an event type"),
        ('{"id": "e", "data": "' + "x" * 300 + '"}', ["--max-event-bytes", "300"], "over the"),
        ('{"id": "e", "data": 1}', ["--to", "nobody"], "to names no endpoint"),
        ('{"id": "e", "data": 1}', ["--max-event-bytes", "0"], "max_event_bytes"),
    ],
)
def test_bad_events_from_the_command_line_are_one_line_and_write_nothing(
    tmp_path: Path, line: str, options: list[str], says: str
) -> None:
    from .test_webhook_senders import run_cli

    db = str(tmp_path / "q.db")
    assert run_cli("init", db).returncode == 0
    before = state(db)
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"id": "ok", "data": 1}\n' + line + "\n")
    refused = run_cli("enqueue", db, str(lines), *options)
    assert refused.returncode != 0 and says in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    assert state(db) == before
