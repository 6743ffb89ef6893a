"""Group commit in the receiving library: a batch of concurrent deliveries decided in one
transaction equals the same deliveries decided one by one (duplicates within the batch,
conflicts, an effect that raises or rejects among good ones), on an application's real
aiosqlite and psycopg connections; a COMMIT that fails answers 503 to each and changes
nothing; replicas sharing a PostgreSQL inbox apply each id once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import psycopg
import pytest

from asnackq.core.inbox import Arrival
from asnackq.http_sink import WebhookReceiver
from asnackq.sink.inbox import SinkUnavailable
from asnackq.sink.receiver import Rejected
from asnackq.store.effects import EffectFailed

from .test_receiving import KINDS, SECRET, App, body, post, receiving, replicas, signed

Delivery = tuple[str, bytes, int | None]  # webhook-id, body, token


async def effect(con: Any, event_id: str, payload: Any) -> None:
    """A ledger row per payment; a payload may ask to fail or to be refused, after it."""
    sql = "INSERT INTO ledger VALUES (?, ?)"
    await con.execute(
        sql if isinstance(con, aiosqlite.Connection) else sql.replace("?", "%s"),
        (event_id, payload["n"]),
    )
    if payload.get("fail"):
        raise RuntimeError("the effect failed")
    if payload.get("reject"):
        raise Rejected("n is refused")


@pytest.fixture(params=KINDS)
async def two_apps(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[App]]:
    """Two fresh databases of one kind, each with its application's ledger."""
    async with contextlib.AsyncExitStack() as stack:
        apps = []
        for name in ("one", "two"):
            if request.param == "sqlite":
                con: Any = await stack.enter_async_context(
                    aiosqlite.connect(tmp_path / f"{name}.db", isolation_level=None)
                )
            else:
                url = request.getfixturevalue("pg_db")()
                con = await stack.enter_async_context(
                    await psycopg.AsyncConnection.connect(url, autocommit=True)
                )
            await con.execute("CREATE TABLE ledger (id TEXT, n INTEGER)")
            apps.append(App(con, request.param))
        yield apps


async def outcome(receiver: WebhookReceiver[Any], delivery: Delivery) -> str:
    """What the library decided for one delivery, as its answer would name it."""
    event_id, data, token = delivery
    arrival = Arrival(event_id, hashlib.sha256(data).hexdigest(), token)
    try:
        return await receiver.inbox.submit(arrival, json.loads(data))
    except EffectFailed as error:
        return "rejected" if isinstance(error.__cause__, Rejected) else "failed"
    except SinkUnavailable:
        return "unavailable"


def scenario(rng: random.Random, size: int) -> list[Delivery]:
    """Deliveries over few ids: repeats, other bodies, effects that fail or refuse."""
    kinds = [{}, {}, {}, {"fail": True}, {"reject": True}]
    found = []
    for _ in range(size):
        payload = {"n": rng.randint(1, 2), **rng.choice(kinds)}
        token = rng.choice([None, rng.randint(1, 9)])
        found.append((f"id-{rng.randint(1, 12)}", json.dumps(payload).encode(), token))
    return found


async def state(app: App) -> tuple[list[Any], list[Any]]:
    rows = await app.rows(
        "SELECT id, deliveries, first_token, last_token FROM asnackq_webhook_inbox ORDER BY id"
    )
    return sorted(await app.ledger()), rows


async def test_a_batch_decides_exactly_as_one_by_one(two_apps: list[App]) -> None:
    alone, together = two_apps
    lone = await WebhookReceiver.within(alone.con, [SECRET], effect)
    grouped = await WebhookReceiver.within(together.con, [SECRET], effect, batch_max=64)
    rng, seen = random.Random(34), set()
    for size in (1, 2, 7, 30, 30, 60):
        deliveries = scenario(rng, size)
        one_by_one = [await outcome(lone, d) for d in deliveries]
        commits = grouped.inbox.commits
        batched = await asyncio.gather(*(outcome(grouped, d) for d in deliveries))
        assert batched == one_by_one, deliveries
        seen.update(one_by_one)
        assert await state(together) == await state(alone)
        if {"failed", "rejected"}.isdisjoint(one_by_one):
            assert grouped.inbox.commits == commits + 1  # (the whole batch, one transaction)
    assert seen == {"applied", "duplicate", "conflict", "failed", "rejected"}


async def test_the_same_id_twice_in_one_batch_is_applied_then_a_duplicate(two_apps):
    app = two_apps[0]
    receiver = await WebhookReceiver.within(app.con, [SECRET], effect, batch_max=8)
    same, other = body(1), body(2)
    batch = [("x", same, 1), ("x", same, 2), ("x", other, 3), ("y", same, None), ("x", same, None)]
    found = await asyncio.gather(*(outcome(receiver, d) for d in batch))
    assert found == ["applied", "duplicate", "conflict", "applied", "duplicate"]
    assert receiver.inbox.commits == 1
    assert await state(app) == ([("x", 1), ("y", 1)], [("x", 3, 1, 2), ("y", 1, None, None)])


async def test_ids_of_any_visible_ascii_are_kept_as_sent(two_apps):
    """A batch's ids reach the inbox as one JSON array: quotes, backslashes and what looks
    like an escape or JSON are ids like any other, each kept as sent."""
    app = two_apps[0]
    receiver = await WebhookReceiver.within(app.con, [SECRET], effect, batch_max=8)
    ids = ['a"b', "c\\d", "e'f", "\\u0041", '{"id":1}', "[]", "~!@#$%^&*()"]
    batch = [(event_id, body(1), 1) for event_id in ids] + [(ids[1], body(1), 2)]
    found = await asyncio.gather(*(outcome(receiver, d) for d in batch))
    assert found == ["applied"] * len(ids) + ["duplicate"]
    ledger, rows = await state(app)
    assert sorted(event_id for event_id, _ in ledger) == sorted(ids)
    assert {row[0]: row[1] for row in rows} == {i: 2 if i == ids[1] else 1 for i in ids}


async def test_a_failing_effect_answers_alone_and_the_others_commit_over_http(two_apps):
    app = two_apps[0]
    async with receiving(app, effect, batch_max=16) as served:
        good, failing, refused = body(3), body(4, fail=True), body(5, reject=True)
        sends = [("g-1", good), ("f-1", failing), ("g-2", good), ("r-1", refused), ("g-1", good)]
        found = await asyncio.gather(*(post(served.url, d, signed(i, d)) for i, d in sends))
    assert [(status, answer["status"]) for status, answer in found] == [
        (200, "applied"),
        (500, "failed"),
        (200, "applied"),
        (422, "rejected"),
        (200, "duplicate"),
    ]
    assert await state(app) == (
        [("g-1", 3), ("g-2", 3)],
        [("g-1", 2, None, None), ("g-2", 1, None, None)],
    )


async def test_a_commit_that_fails_answers_503_to_each_and_changes_nothing(two_apps):
    """A deferred foreign key: every statement succeeds, the COMMIT refuses the batch."""
    app = two_apps[0]
    deferred = "REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED"
    if app.kind == "sqlite":
        await app.con.execute("PRAGMA foreign_keys = ON")
    await app.con.execute("CREATE TABLE parents (id TEXT PRIMARY KEY)")
    await app.con.execute(f"CREATE TABLE children (id TEXT, parent TEXT {deferred})")
    await app.con.execute(app.sql("INSERT INTO parents VALUES (?)"), ("p",))

    async def child(con: Any, event_id: str, payload: Any) -> None:
        await con.execute(app.sql("INSERT INTO children VALUES (?, ?)"), (event_id, payload["p"]))

    receiver = await WebhookReceiver.within(app.con, [SECRET], child, batch_max=8)
    batch = [(f"c-{i}", json.dumps({"p": p}).encode(), None) for i, p in enumerate("pqp")]
    found = await asyncio.gather(*(outcome(receiver, d) for d in batch))
    assert found == ["unavailable"] * 3
    assert await app.rows("SELECT count(*) FROM children") == [(0,)]
    assert await app.rows("SELECT count(*) FROM asnackq_webhook_inbox") == [(0,)]
    found = [await outcome(receiver, d) for d in batch]  # alone, only the bad one fails
    assert found == ["applied", "unavailable", "applied"]


@pytest.mark.process
async def test_replicas_group_committing_on_one_postgresql_inbox_apply_each_id_once(pg_db):
    async with replicas(pg_db()) as (first, second):
        receivers = [
            await WebhookReceiver.within(app.con, [SECRET], effect, batch_max=32)
            for app in (first, second)
        ]
        ids = [f"p-{n % 7}" for n in range(60)]
        found = await asyncio.gather(
            *(outcome(r, (i, body(1), None)) for i in ids for r in receivers)
        )
        assert (found.count("applied"), found.count("duplicate")) == (7, 113)
        assert sorted(await first.ledger()) == [(f"p-{n}", 1) for n in range(7)]
