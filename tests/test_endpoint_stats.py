"""Each endpoint seen: ``asnackq stats``, the dashboard and ``/metrics`` show its state,
backlog, oldest pending age, deliveries in flight, done and dead, and what its workers say
of its breaker and limit (``AsyncQueue.note_endpoints``); ``asnackq inspect`` and the
dashboard's inspector show an event's deliveries by endpoint with their attempts.  On a
file and on a PostgreSQL database, through real processes where the CLI is involved."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asnackq import ops
from asnackq.aio import AsyncQueue, Fleet
from asnackq.core import endpoint_workers as ew
from asnackq.core import endpoints, events, lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint
from asnackq.dispatch.metrics import WorkerMetrics
from asnackq.ops import per_endpoint
from asnackq.ops.watcher import Watcher
from asnackq.store import readers
from asnackq.store.targets import is_url
from asnackq.wire import metrics
from asnackq.wire import webhooks as wh

from .conftest import asnackq_cli, execute
from .test_endpoints import where as a_queue
from .test_event_deliveries import hooks
from .test_fleet import FAST, done_of, running, until

where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
URL = "http://127.0.0.1:9/hook"


def stats_of(where: str, now_ms: int) -> dict[str, dict[str, Any]]:
    """``ops.stats``' endpoints, by name, read as the commands read them."""
    with readers.read_only(where, "jobs") as con:
        return {e["name"]: e for e in ops.stats(con, now_ms)["endpoints"]}


async def a_queue_with_traffic(queue: AsyncQueue, now: int) -> None:
    """Endpoints a (5 deliveries: 1 done, 1 dead, 1 leased, 2 pending), b (3 pending,
    enqueued 10 s before now), c (disabled, none), and a plain job."""
    for name in ("a", "b", "c"):
        await queue.add_endpoint(Endpoint(name, URL, types=(f"{name}.x",)), now_ms=now - 20_000)
    await queue.disable_endpoint("c", "partner asked [bold]to pause[/bold]", now_ms=now - 1)
    events = [{"id": f"a{i}", "type": "a.x", "data": i} for i in range(5)]
    await queue.enqueue_many(events, now_ms=now - 5_000)
    await queue.enqueue_many(
        [{"id": f"b{i}", "type": "b.x", "data": {"n": i}} for i in range(3)], now_ms=now - 10_000
    )
    await queue.enqueue({"id": "plain", "qty": 1}, now_ms=now - 10_000)
    lane = queue.in_lane(lanes.Lane("a"))
    for outcome in ("ok", "permanent"):
        ticket = await lane.claim("w1", now - 4_000, 60_000)
        assert ticket is not None
        await lane.finish(ticket, outcome, now - 4_000)
    assert await lane.claim("w1", now - 4_000, 60_000) is not None


async def test_stats_show_each_endpoints_deliveries_and_workers(where: str) -> None:
    now = w.epoch_ms()
    async with AsyncQueue.open(where) as queue:
        await a_queue_with_traffic(queue, now)
        assert await queue.note_endpoints("w1", [("a", True, 4, 1), ("b", False, 8, 0)], now) == 2
        await queue.note_endpoints("w2", [ew.Seen("a", False, 2, 0)], now_ms=now)
        await queue.note_endpoints("gone", [("b", True, 1, 1)], now - ew.FRESH_MS - 1)
        found = stats_of(where, now)
        assert list(found) == ["a", "b", "c"]
        a, b, c = found["a"], found["b"], found["c"]
        counts = ("backlog", "in_flight", "done", "dead")
        assert [a[k] for k in counts] == [2, 1, 1, 1]
        assert [b[k] for k in counts] == [3, 0, 0, 0]
        assert [c[k] for k in counts] == [0, 0, 0, 0]
        # The oldest pending delivery's wait since its event's intake.
        assert (a["oldest_pending_ms"], b["oldest_pending_ms"], c["oldest_pending_ms"]) == (
            5_000,
            10_000,
            None,
        )
        assert (a["state"], c["state"]) == ("enabled", "disabled")
        assert c["disabled_reason"] == "partner asked [bold]to pause[/bold]"
        assert c["disabled_at_ms"] == now - 1
        assert (a["breaker"], a["limit"]) == ("open on 1 of 2", 6)
        assert [(s["owner"], s["in_flight"]) for s in a["workers"]] == [("w1", 1), ("w2", 0)]
        assert (b["breaker"], b["limit"]) == ("closed", 8)  # ("gone" said it 15 s ago)
        assert (c["breaker"], c["limit"], c["workers"]) == (per_endpoint.NO_WORKER, None, [])
        # A note is its owner's whole report: w1 serves b alone now; every breaker open.
        await queue.note_endpoints("w1", [("b", True, 3, 2)], now + 1)
        await queue.note_endpoints("w2", [("a", True, 2, 2)], now + 1)
        again = stats_of(where, now + 1)
        assert (again["a"]["breaker"], again["a"]["limit"]) == ("open", 2)
        assert (again["b"]["breaker"], again["b"]["limit"]) == ("open", 3)
        # Rows not seen for an hour are forgotten by anyone's next note.
        await queue.note_endpoints("w3", [], now + ew.FORGET_MS + 2)
        assert execute(where, "SELECT count(*) FROM asnackq_endpoint_workers") == [(0,)]


async def test_endpoints_are_counted_a_chunk_at_a_time_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where, now = str(tmp_path / "q.db"), w.epoch_ms()
    async with AsyncQueue.open(where) as queue:
        await a_queue_with_traffic(queue, now)
    whole = stats_of(where, now)
    monkeypatch.setattr(per_endpoint, "CHUNK", 2)  # a, b in one statement, c in another
    assert stats_of(where, now) == whole


async def test_a_queue_without_endpoints_or_notes_shows_none(where: str) -> None:
    now = w.epoch_ms()
    async with AsyncQueue.open(where) as queue:
        await queue.enqueue({"id": "plain", "qty": 1})
        assert stats_of(where, now) == {}
        await queue.add_endpoint(Endpoint("a", URL))  # no event yet, no note
        assert stats_of(where, now)["a"]["backlog"] == 0
        assert stats_of(where, now)["a"]["breaker"] == per_endpoint.NO_WORKER


@pytest.mark.parametrize(
    ("owner", "rows", "said"),
    [
        ("w 1", [], "owner"),
        ("w1", "a", "rows must be a list"),
        ("w1", [("a", 1, 4, 0)], "breaker_open must be True or False"),
        ("w1", [("a", True, -1, 0)], "limit"),
        ("w1", [("a", True, 4, 2**21)], "in_flight"),
        ("w1", [("a", True, 4)], "a row is"),
        ("w1", [("bad name", True, 4, 0)], "endpoint name"),
        ("w1", [("a", True, 4, 0), ("a", False, 1, 0)], "twice"),
    ],
)
async def test_a_bad_note_is_refused_and_writes_nothing(
    tmp_path: Path, owner: Any, rows: Any, said: str
) -> None:
    where = tmp_path / "q.db"
    async with AsyncQueue.open(where) as queue:
        with pytest.raises(ValueError, match=said):
            await queue.note_endpoints(owner, rows)
    tables = sqlite3.connect(where).execute("SELECT name FROM sqlite_master").fetchall()
    assert ("asnackq_endpoint_workers",) not in tables


def test_the_counts_are_one_index_only_read_whatever_the_backlog(tmp_path: Path) -> None:
    """Every endpoint's counts are one statement, each count a range of the lane index
    read without the table (SQLite's plan says COVERING INDEX); the oldest pending age is
    one step of that index in id order (no sort)."""
    con = sqlite3.connect(tmp_path / "q.db")
    for statement in (*w.SCHEMA, *endpoints.SCHEMA, *events.SCHEMA):
        con.execute(statement)
    sql = per_endpoint.sql_counts(3, on_sqlite=True)
    plan = [row[3] for row in con.execute(f"EXPLAIN QUERY PLAN {sql}", ["x"] * 9)]
    ranges = [step for step in plan if "asnackq_jobs_by_lane" in step]
    assert len(ranges) == 5, plan
    assert all("status=? AND id>? AND id<?" in step for step in ranges), plan
    assert all("COVERING INDEX" in step for step in ranges), plan
    assert not any("TEMP B-TREE" in step for step in plan), plan


@pytest.mark.process
async def test_stats_and_inspect_commands_show_endpoints_and_an_events_deliveries(
    where: str,
) -> None:
    now = w.epoch_ms()
    async with AsyncQueue.open(where) as queue:
        await a_queue_with_traffic(queue, now)
        await queue.note_endpoints("w1", [("a", True, 4, 1)])
    code, out, err = await asnackq_cli("stats", where, "--json")
    assert (code, err) == (0, "")
    shown = {e["name"]: e for e in json.loads(out)["endpoints"]}
    assert [(e["backlog"], e["in_flight"], e["done"], e["dead"]) for e in shown.values()] == [
        (2, 1, 1, 1),
        (3, 0, 0, 0),
        (0, 0, 0, 0),
    ]
    assert (shown["a"]["breaker"], shown["a"]["limit"]) == ("open", 4)
    code, out, err = await asnackq_cli("stats", where)
    assert code == 0, err
    assert "3 endpoints" in out

    code, out, err = await asnackq_cli("inspect", where, "a1", "--json")
    assert (code, err) == (0, "")
    story = json.loads(out)
    assert story["job"] is None and story["event"]["event"]["type"] == "a.x"
    [delivery] = story["event"]["deliveries"]
    assert delivery["endpoint"] == "a" and delivery["job"] == lanes.delivery_id("a", 2)
    assert (delivery["status"], delivery["attempts"], delivery["reason"]) == (
        "dead",
        1,
        "permanent",
    )
    code, out, err = await asnackq_cli("inspect", where, lanes.delivery_id("a", 1))
    assert code == 0, err
    assert "done" in out and "a0" in out  # the delivery's job, its event and endpoint
    code, out, err = await asnackq_cli("inspect", where, "b2")
    assert code == 0 and "event b2 (b.x): 1 delivery" in out, out
    code, out, err = await asnackq_cli("inspect", where, "ghost")
    assert (code, out, err) == (1, "", "asnackq inspect: no job or event 'ghost' in the queue\n")
    code, out, err = await asnackq_cli("inspect", where, "no such id!")
    assert code == 2 and len(err.splitlines()) == 1 and out == ""


async def test_the_dashboard_state_metrics_and_inspector_show_each_endpoint(where: str) -> None:
    now = w.epoch_ms()
    async with AsyncQueue.open(where) as queue:
        await a_queue_with_traffic(queue, now)
        await queue.note_endpoints("w1", [("a", True, 4, 1), ("b", False, 8, 0)])
    watcher = Watcher(where)
    await watcher.sample()
    shown = {e["name"]: e for e in watcher.state["stats"]["endpoints"]}
    assert [shown[n]["backlog"] for n in "abc"] == [2, 3, 0]
    families = {
        f.name: f
        for f in text_string_to_metric_families(
            metrics.render(metrics.queue_families(watcher.state["stats"]))
        )
    }
    deliveries = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in families["asnackq_endpoint_deliveries"].samples
    }
    assert deliveries[("a", "pending")] == 2 and deliveries[("a", "leased")] == 1
    assert deliveries[("a", "done")] == 1 and deliveries[("a", "dead")] == 1

    def by_endpoint(name: str) -> dict[str, float]:
        return {s.labels["endpoint"]: s.value for s in families[name].samples}

    assert by_endpoint("asnackq_endpoint_enabled") == {"a": 1, "b": 1, "c": 0}
    assert by_endpoint("asnackq_endpoint_breaker_open_workers") == {"a": 1, "b": 0, "c": 0}
    assert by_endpoint("asnackq_endpoint_limit") == {"a": 4, "b": 8, "c": 0}
    assert by_endpoint("asnackq_endpoint_workers") == {"a": 1, "b": 1, "c": 0}
    oldest = by_endpoint("asnackq_endpoint_oldest_pending_age_seconds")
    assert oldest["c"] == 0 and oldest["b"] >= 10
    story = await watcher.look_up("b1")
    assert story is not None and story["job"] is None
    assert story["event"]["type"] == "b.x"
    assert [(d["endpoint"], d["status"], d["attempts"]) for d in story["deliveries"]] == [
        ("b", "pending", 0)
    ]
    story = await watcher.look_up(lanes.delivery_id("a", 1))
    assert story is not None and story["delivery"] == {"event": "a0", "endpoint": "a"}
    assert story["deliveries"] == []
    if not is_url(where):
        plain = await watcher.look_up("plain")
        assert plain is not None and plain["delivery"] is None and plain["event"] is None


async def test_a_fleets_endpoints_on_the_workers_metrics_and_in_stats(tmp_path: Path) -> None:
    """A fleet's Dispatchers on the worker's ``/metrics`` (``watch_endpoint`` as each starts,
    ``unwatch_endpoint`` as it stops), each sample labelled ``endpoint="NAME"``; its notes
    (as the fleet writes them, from its Dispatchers) in ``ops.stats``."""
    secret = wh.new_secret()
    where = str(tmp_path / "q.db")
    exporter = WorkerMetrics("127.0.0.1", 0, allow_remote=False)
    async with (
        hooks(secret) as (_, healthy_url),
        hooks(secret, 503) as (_, failing_url),
        AsyncQueue.open(where) as queue,
        exporter,
    ):
        await queue.add_endpoint(Endpoint("healthy", healthy_url, secrets=(secret,)))
        await queue.add_endpoint(
            Endpoint("failing", failing_url, secrets=(secret,), concurrency=2, timeout_s=0.2)
        )
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(20)])
        fleet = Fleet(
            queue,
            owner="fleet",
            retry=FAST,
            refresh_s=0.05,
            on_start=exporter.watch_endpoint,
            on_stop=exporter.unwatch_endpoint,
        )
        async with running(fleet):
            await until(lambda: done_of(where, "healthy") == 20, "the healthy deliveries")
            await until(lambda: fleet.dispatchers()["failing"].paused, "the breaker open")
            families = await scrape(exporter)
            rows = [
                (n, d.paused, d.snapshot()["concurrency"], 0)
                for n, d in fleet.dispatchers().items()
            ]
            await queue.note_endpoints(fleet.owner, rows)
            seen = stats_of(where, w.epoch_ms())
            await queue.disable_endpoint("failing", "answers 503")
            await until(lambda: "failing" not in exporter.endpoints, "the failing one unwatched")
            after = await scrape(exporter)
    samples = labelled(families)
    assert samples[("asnackq_worker_done_total", "healthy")] == 20
    assert samples[("asnackq_worker_done_total", "failing")] == 0
    assert samples[("asnackq_worker_breaker_open", "failing")] == 1
    assert samples[("asnackq_worker_breaker_open", "healthy")] == 0
    assert samples[("asnackq_worker_concurrency", "failing")] == 2
    assert samples[("asnackq_worker_concurrency", "healthy")] >= 1
    assert samples[("asnackq_worker_breaker_outages_total", "failing")] >= 1
    assert {key[1] for key in labelled(after)} == {"healthy"}
    assert (seen["failing"]["breaker"], seen["failing"]["limit"]) == ("open", 2)
    assert seen["healthy"]["breaker"] == "closed" and seen["healthy"]["done"] == 20
    assert seen["failing"]["backlog"] + seen["failing"]["in_flight"] == 20


async def scrape(exporter: WorkerMetrics) -> list[Any]:
    """``GET /metrics`` of a running exporter, parsed."""
    assert exporter.url is not None
    async with aiohttp.ClientSession() as session, session.get(exporter.url) as answer:
        assert answer.status == 200
        return list(text_string_to_metric_families(await answer.text()))


def labelled(families: list[Any]) -> dict[tuple[str, str], float]:
    """Each sample labelled with an endpoint, by (sample name, endpoint)."""
    return {
        (sample.name, sample.labels["endpoint"]): sample.value
        for family in families
        for sample in family.samples
        if "endpoint" in sample.labels and "reason" not in sample.labels
    }
