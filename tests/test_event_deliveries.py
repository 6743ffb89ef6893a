"""Deliveries sent: a worker in an endpoint's lane claims that endpoint's deliveries alone
and sends each its event's stored body, the event's id as ``webhook-id``, signed with the
endpoint's keyring; a sink's worker (the plain lane) never takes a delivery; each delivery
has a job's lease, attempts, dead letter and redrive.  Real aiohttp receivers on 127.0.0.1
port 0 verify every request with the official Standard Webhooks library; a worker killed
with SIGKILL mid-run and restarted leaves every event applied once at a WebhookReceiver."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import aiosqlite
import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint
from asnackq.dispatch.endpoint import EndpointSend
from asnackq.http_sink import WebhookReceiver
from asnackq.wire import webhooks as wh
from asnackq.wire.send import TOKEN_HEADER, AsyncHttpSender

from .conftest import asnackq_cli, execute
from .sinks import serving, sink
from .test_endpoints import where as a_queue

where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
FAST = w.Retry(5, 20)


class Seen(NamedTuple):
    webhook_id: str
    body: bytes
    token: int


class Hooks:
    """A webhook receiver verifying each request with the official library; answers
    ``statuses`` in turn (the last repeats)."""

    def __init__(self, secret: str, *statuses: int) -> None:
        self.verifier = Webhook(secret)
        self.statuses = list(statuses or (204,))
        self.seen: list[Seen] = []
        self.refused = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {key.lower(): value for key, value in request.headers.items()}
        try:
            self.verifier.verify(body, headers)
        except WebhookVerificationError:
            self.refused += 1
            return web.Response(status=401)
        self.seen.append(Seen(headers["webhook-id"], body, int(headers[TOKEN_HEADER.lower()])))
        status = self.statuses[min(len(self.seen), len(self.statuses)) - 1]
        return web.Response(status=status)


@contextlib.asynccontextmanager
async def hooks(secret: str, *statuses: int) -> AsyncIterator[tuple[Hooks, str]]:
    receiver = Hooks(secret, *statuses)
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    async with serving(app) as running:
        yield receiver, f"{running.base}/hook"


def send_to(queue: AsyncQueue, name: str) -> EndpointSend:
    return EndpointSend(
        name,
        read=lambda: queue.endpoint(name),
        disable=lambda reason: queue.disable_endpoint(name, reason),
        payload=queue.delivery,
        refresh_s=0.0,
    )


async def lane_run(queue: AsyncQueue, name: str, **options: Any) -> Any:
    """A run in the lane of the endpoint ``name`` until that lane is empty."""
    lane = queue.in_lane(lanes.Lane(name))
    async with send_to(queue, name) as send:
        return await Dispatcher(lane, send, owner=f"in-{name}", retry=FAST, **options).run()


def bodies(where: str) -> dict[str, bytes]:
    return {i: bytes(b) for i, b in execute(where, "SELECT id, body FROM asnackq_events")}


def statuses(where: str) -> dict[str, tuple[str, str]]:
    rows = execute(
        where,
        "SELECT d.job, j.status, d.endpoint FROM asnackq_deliveries AS d"
        " JOIN jobs AS j ON j.id = d.job",
    )
    return {job: (status, endpoint) for job, status, endpoint in rows}


async def test_a_lane_sends_its_endpoints_deliveries_alone_and_the_plain_lane_none(
    where: str, tmp_path: Path
) -> None:
    one, two = wh.new_secret(), wh.new_secret()
    async with (
        hooks(one) as (orders, orders_url),
        hooks(two) as (users, users_url),
        sink(tmp_path / "sink.db") as plain_sink,
        AsyncQueue.open(where) as queue,
    ):
        await queue.add_endpoint(Endpoint("orders", orders_url, ("order.*",), (one,)))
        await queue.add_endpoint(Endpoint("users", users_url, ("user.*",), (two,)))
        for i in range(6):
            await queue.enqueue({"id": f"o{i}", "type": "order.paid", "data": {"n": i}})
        await queue.enqueue_many([{"id": f"u{i}", "type": "user.new", "data": i} for i in range(4)])
        await queue.enqueue({"id": "p1", "qty": 2})
        first = await lane_run(queue, "orders", concurrency=3)
        waiting = statuses(where)
        assert users.seen == [] and first.done == 6
        assert await queue.read(w.SQL_ACTIVE) == [(5,)]  # 4 users' and the plain job wait
        second = await lane_run(queue, "users")
        plain = queue.in_lane(lanes.PLAIN)
        async with AsyncHttpSender(plain_sink.url) as send:
            third = await Dispatcher(plain, send, owner="sink").run()
    assert (second.done, third.done) == (4, 1)
    assert {s for s, e in waiting.values() if e == "users"} == {"pending"}
    assert (orders.refused, users.refused) == (0, 0)
    stored = bodies(where)
    assert sorted(s.webhook_id for s in orders.seen) == [f"o{i}" for i in range(6)]
    assert all(s.body == stored[s.webhook_id] for s in orders.seen + users.seen)
    assert json.loads(users.seen[0].body)["type"] == "user.new"
    assert set(statuses(where).values()) == {("done", "orders"), ("done", "users")}
    assert execute(where, "SELECT status FROM jobs WHERE id = 'p1'") == [("done",)]


async def test_a_delivery_has_a_jobs_attempts_dead_letter_and_redrive(where: str) -> None:
    secret = wh.new_secret()
    async with hooks(secret, 500, 400, 204) as (partner, url), AsyncQueue.open(where) as queue:
        await queue.add_endpoint(Endpoint("partner", url, secrets=(secret,)))
        made = await queue.publish({"id": "ev", "type": "a.b", "data": [1, 2]})
        job = made.deliveries[0][1]
        first = await lane_run(queue, "partner")  # 500: retried, then 400: dead
        dead = execute(where, f"SELECT status, reason, attempts FROM jobs WHERE id = '{job}'")
        assert await queue.redrive(job, note="fixed-upstream")
        second = await lane_run(queue, "partner")
    assert (first.dead, second.done, dead) == (1, 1, [("dead", "permanent", 2)])
    assert [s.webhook_id for s in partner.seen] == ["ev"] * 3  # the event's id, every attempt
    assert [s.token for s in partner.seen] == [1, 2, 3]  # each attempt its own lease
    assert len({s.body for s in partner.seen}) == 1
    kept = execute(where, f"SELECT status FROM asnackq_attempts WHERE id = '{job}' ORDER BY seq")
    assert [row[0] for row in kept] == [500, 400, 204]


async def test_a_job_that_is_no_delivery_is_refused_never_sent_as_id_and_qty(
    tmp_path: Path,
) -> None:
    secret = wh.new_secret()
    async with hooks(secret) as (partner, url), AsyncQueue.open(tmp_path / "q.db") as queue:
        await queue.add_endpoint(Endpoint("partner", url, secrets=(secret,)))
        await queue.publish({"id": "ev", "data": 1})  # (the tables)
        async with send_to(queue, "partner") as send:
            with pytest.raises(w.Permanent, match="'plain' is no delivery"):
                await send({"id": "plain", "qty": 1}, 1)
    assert partner.seen == []


# --- a worker killed mid-run --------------------------------------------------------------

APPLIED = "CREATE TABLE IF NOT EXISTS applied (id TEXT PRIMARY KEY, n INTEGER NOT NULL)"


async def apply(con: aiosqlite.Connection, webhook_id: str, payload: Any) -> None:
    await con.execute("INSERT INTO applied (id, n) VALUES (?, ?)", (webhook_id, payload["data"]))


async def cli(*args: str) -> tuple[int, str]:
    code, out, err = await asnackq_cli(*args)
    return code, out + err


@pytest.mark.process
async def test_a_worker_killed_mid_run_and_restarted_applies_every_event_once(
    where: str, tmp_path: Path
) -> None:
    secret, queue_db = wh.new_secret(), where
    app_con = await aiosqlite.connect(tmp_path / "app.db", isolation_level=None)
    await app_con.execute_fetchall(APPLIED)
    try:
        receiver = await WebhookReceiver.within(app_con, [secret], apply)
        app = web.Application()
        app.router.add_post("/hook", receiver.handle)
        async with serving(app) as running, AsyncQueue.open(queue_db) as queue:
            await queue.add_endpoint(
                Endpoint("partner", f"{running.base}/hook", secrets=(secret,), success="ack")
            )
            await queue.add_endpoint(Endpoint("elsewhere", "http://127.0.0.1:9/x"))
            await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(30)])
            work = ("work", queue_db, "--endpoint", "partner", "--lease-ms", "1000")
            killed, said = await cli(*work, "--kill-after-acks", "7", "--concurrency", "4")
            assert killed == -9, said
            done, said = await cli(*work, "--until-empty", "--json")
            assert done == 0, said
            applied = await app_con.execute_fetchall("SELECT id, n FROM applied ORDER BY n")
    finally:
        await app_con.close()
    assert [tuple(row) for row in applied] == [(f"e{i}", i) for i in range(30)]
    assert receiver.counts["applied"] == 30
    lanes_now = statuses(queue_db)
    assert {s for s, e in lanes_now.values() if e == "partner"} == {"done"}
    assert {s for s, e in lanes_now.values() if e == "elsewhere"} == {"pending"}
