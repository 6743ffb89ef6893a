"""OpenTelemetry traces in one process: the SDK's in-memory exporter, a real Dispatcher, a
real aiohttp sink on port 0, real queue files (and a PostgreSQL queue)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import defaultdict

import aiosqlite
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from asnackq import ops
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import tracing
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.store import sessions
from asnackq.wire.send import AsyncHttpSender, HttpSender

from .pgdb import query
from .sinks import peer, serving, sink


@pytest.fixture
def exported():
    """Spans go to memory for this test only (``tracing.set_provider``)."""
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.set_provider(provider)
    try:
        yield memory
    finally:
        tracing.set_provider(None)
        provider.shutdown()


def by_trace(spans):
    traces = defaultdict(list)
    for span in spans:
        traces[span.context.trace_id].append(span)
    return traces


def stored(db):
    con = sqlite3.connect(db)
    try:
        return dict(con.execute("SELECT job_id, traceparent FROM asnackq_job_traces"))
    finally:
        con.close()


def traceparent(span):
    return tracing.traceparent(span)


async def test_one_trace_per_job_from_enqueue_to_the_sinks_decision(exported, db, tmp_path):
    async with AsyncQueue.open(db) as queue:
        await queue.enqueue_many([{"id": f"job-{i}", "qty": i + 1} for i in range(6)])
        await queue.enqueue({"id": "job-0", "qty": 1})  # a duplicate intake keeps its trace
        async with sink(tmp_path / "s.db") as running, AsyncHttpSender(running.url) as send:
            summary = await Dispatcher(queue, send, owner="w1", concurrency=3).run()
    assert summary.done == 6
    traces = by_trace(exported.get_finished_spans())
    enqueues = {
        s.attributes["messaging.message.id"]: s
        for s in exported.get_finished_spans()
        if s.kind is SpanKind.PRODUCER and s.attributes["asnackq.intake"] == "inserted"
    }
    assert sorted(enqueues) == [f"job-{i}" for i in range(6)]
    assert stored(db) == {job_id: traceparent(span) for job_id, span in enqueues.items()}
    for job_id, enqueue in enqueues.items():
        spans = {s.kind: s for s in traces[enqueue.context.trace_id]}
        assert set(spans) == {
            SpanKind.PRODUCER,
            SpanKind.CONSUMER,
            SpanKind.CLIENT,
            SpanKind.SERVER,
        }
        deliver, post, server = (
            spans[SpanKind.CONSUMER],
            spans[SpanKind.CLIENT],
            spans[SpanKind.SERVER],
        )
        assert enqueue.parent is None and deliver.parent.span_id == enqueue.context.span_id
        assert post.parent.span_id == deliver.context.span_id
        assert server.parent.span_id == post.context.span_id and server.parent.is_remote
        assert deliver.attributes["messaging.message.id"] == job_id
        assert deliver.attributes["asnackq.token"] == 1 == server.attributes["asnackq.token"]
        assert deliver.attributes["asnackq.attempt"] == 1
        assert deliver.attributes["asnackq.owner"] == "w1"
        assert deliver.attributes["asnackq.outcome"] == "ok"
        assert deliver.attributes["asnackq.result"] == "done"
        assert server.attributes["asnackq.inbox.decision"] == "applied"
        assert post.attributes["http.response.status_code"] == 200
        assert server.attributes["http.route"] == "/events"
    duplicate = [s for s in enqueues.values() if s.attributes["asnackq.intake"] == "duplicate"]
    assert duplicate == []  # (the duplicate's span is its own trace, stored nowhere)


async def test_retries_and_dead_jobs_are_attempts_of_the_same_trace(exported, db):
    answers = iter([500, 200])

    async def flaky(request: web.Request) -> web.Response:
        body = await request.json()
        if body["id"] == "never":
            return web.json_response({"error": "no"}, status=422)
        status = next(answers)
        return web.json_response({"id": body["id"], "status": "applied"}, status=status)

    async with AsyncQueue.open(db) as queue:
        await queue.enqueue({"id": "later", "qty": 1})
        await queue.enqueue({"id": "never", "qty": 1})
        async with serving(peer(flaky)) as running, AsyncHttpSender(running.url) as send:
            retry = w.Retry(base_ms=1, cap_ms=1)
            await Dispatcher(queue, send, owner="w1", concurrency=1, retry=retry).run()
    spans = exported.get_finished_spans()
    attempts = sorted(
        (s.attributes["messaging.message.id"], s.attributes["asnackq.attempt"], s)
        for s in spans
        if s.kind is SpanKind.CONSUMER
    )
    results = [(job, n, s.attributes["asnackq.result"]) for job, n, s in attempts]
    assert results == [("later", 1, "retry"), ("later", 2, "done"), ("never", 1, "dead")]
    assert attempts[0][2].context.trace_id == attempts[1][2].context.trace_id
    assert [s.attributes["asnackq.token"] for _, _, s in attempts[:2]] == [1, 2]
    assert attempts[2][2].attributes["asnackq.dead_reason"] == "permanent"
    failed = [s for s in spans if s.kind is SpanKind.CLIENT and not s.status.is_ok]
    assert sorted(s.attributes["http.response.status_code"] for s in failed) == [422, 500]


async def test_a_finish_the_fence_refuses_is_a_stale_attempt(exported, db):
    """While the first send is at the sink, its lease lapses and another worker claims the
    job: the first worker's finish is stale; the thief's claim is untraced (no span)."""

    def steal() -> w.Ticket | None:
        con = w.open_queue(db)
        try:
            return w.claim(con, "thief", epoch_ms() + 10_000, 60_000)
        finally:
            con.close()

    async def thief(request: web.Request) -> web.Response:
        body = await request.json()
        # In a thread: the event loop goes on (the Dispatcher's transaction needs it).
        assert await asyncio.to_thread(steal) is not None
        return web.json_response({"id": body["id"], "status": "applied"})

    async with AsyncQueue.open(db) as queue:
        await queue.enqueue({"id": "j", "qty": 1})
        async with serving(peer(thief)) as running, AsyncHttpSender(running.url) as send:
            summary = await Dispatcher(queue, send, owner="w1").run(until_empty=False)
    assert summary.stale == 1
    (attempt,) = [s for s in exported.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert attempt.attributes["asnackq.result"] == "stale"
    assert attempt.attributes["asnackq.outcome"] == "ok"


async def test_a_redrive_continues_the_jobs_trace_linked_to_the_operators_action(
    exported, db, tmp_path
):
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=422)

    async with AsyncQueue.open(db) as queue:
        await queue.enqueue({"id": "j", "qty": 1})
        async with serving(peer(refuse)) as running, AsyncHttpSender(running.url) as send:
            await Dispatcher(queue, send, owner="w1").run()
        (enqueue,) = [s for s in exported.get_finished_spans() if s.kind is SpanKind.PRODUCER]
        with sessions.open_session(db) as store:
            ops.redrive(store, "j", epoch_ms(), 60_000, "sink-fixed")
        async with sink(tmp_path / "s.db") as running, AsyncHttpSender(running.url) as send:
            assert (await Dispatcher(queue, send, owner="w2").run()).done == 1
    spans = exported.get_finished_spans()
    action = next(s for s in spans if s.name == "redrive")
    redrive = next(s for s in spans if s.name == "redrive jobs")
    first, second = sorted(
        (s for s in spans if s.kind is SpanKind.CONSUMER), key=lambda s: s.start_time
    )
    assert first.attributes["asnackq.result"] == "dead"
    assert redrive.parent.span_id == enqueue.context.span_id
    assert redrive.context.trace_id == enqueue.context.trace_id != action.context.trace_id
    assert [link.context.span_id for link in redrive.links] == [action.context.span_id]
    assert action.attributes["asnackq.note"] == "sink-fixed"
    assert second.parent.span_id == redrive.context.span_id
    assert second.attributes["asnackq.result"] == "done"
    assert stored(db) == {"j": traceparent(redrive)}


def test_cli_intakes_store_each_jobs_trace_in_their_transaction(exported, db):
    ops.enqueue_all(db, [{"id": "a", "qty": 1}, {"id": "b", "qty": 2}])
    ops.enqueue_all(db, [{"id": "a", "qty": 1}])  # a duplicate keeps the first trace
    first = [
        s for s in exported.get_finished_spans() if s.attributes["asnackq.intake"] == "inserted"
    ]
    assert stored(db) == {s.attributes["messaging.message.id"]: traceparent(s) for s in first}
    assert len(first) == 2


def test_the_sync_sender_sends_its_client_spans_context(exported, tmp_path):
    seen = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("traceparent"))
        return web.json_response({"id": "x", "status": "applied"})

    async def run():
        async with serving(peer(record)) as running:
            with HttpSender(running.url) as send:
                await asyncio.to_thread(send, {"id": "x", "qty": 1}, 3)

    asyncio.run(run())
    (post,) = exported.get_finished_spans()
    assert post.kind is SpanKind.CLIENT and seen == [traceparent(post)]


async def test_with_tracing_off_no_row_no_header_no_span(db, tmp_path):
    seen = []

    async def record(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body = await request.json()
        return web.json_response({"id": body["id"], "status": "applied"})

    async with AsyncQueue.open(db) as queue:
        await queue.enqueue({"id": "a", "qty": 1})
        async with serving(peer(record)) as running, AsyncHttpSender(running.url) as send:
            assert (await Dispatcher(queue, send, owner="w1").run()).done == 1
    ops.enqueue_all(db, [{"id": "b", "qty": 1}])
    assert len(seen) == 1 and "traceparent" not in {h.lower() for h in seen[0]}
    con = sqlite3.connect(db)
    try:
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master")}
    finally:
        con.close()
    assert "asnackq_job_traces" not in tables


async def test_on_postgresql_the_trace_is_stored_and_continued(exported, pg_db, tmp_path):
    url = pg_db()
    sessions.init(url)
    async with AsyncQueue.open(url) as queue:
        await queue.enqueue_many([{"id": "a", "qty": 1}, {"id": "b", "qty": 2}])
        async with sink(tmp_path / "s.db") as running, AsyncHttpSender(running.url) as send:
            assert (await Dispatcher(queue, send, owner="w1").run()).done == 2
    ops.enqueue_all(url, [{"id": "c", "qty": 3}])
    spans = exported.get_finished_spans()
    enqueues = {
        s.attributes["messaging.message.id"]: s for s in spans if s.kind is SpanKind.PRODUCER
    }
    assert query(url, "SELECT job_id, traceparent FROM asnackq_job_traces ORDER BY 1") == [
        (job_id, traceparent(enqueues[job_id])) for job_id in "abc"
    ]
    for deliver in (s for s in spans if s.kind is SpanKind.CONSUMER):
        enqueue = enqueues[deliver.attributes["messaging.message.id"]]
        assert deliver.parent.span_id == enqueue.context.span_id


async def test_the_sinks_conflict_and_an_unanswered_send_are_recorded(exported, db, tmp_path):
    """The sink holds ``x`` with another qty (409 conflict: dead, permanent); ``y``'s ACK
    names another id (a bad ACK: no outcome, the job stays leased)."""

    async def wrong_ack(request: web.Request) -> web.Response:
        return web.json_response({"id": "not-y", "status": "applied"})

    async with sink(tmp_path / "s.db") as running:
        async with AsyncHttpSender(running.url) as send:
            assert await send({"id": "x", "qty": 5}, None) is True  # (untraced: no span)
        async with AsyncQueue.open(db) as queue:
            await queue.enqueue({"id": "x", "qty": 1})
            async with AsyncHttpSender(running.url) as send:
                await Dispatcher(queue, send, owner="w1").run()
            await queue.enqueue({"id": "y", "qty": 1})
            async with serving(peer(wrong_ack)) as bad, AsyncHttpSender(bad.url) as send:
                summary = await Dispatcher(queue, send, owner="w2").run(until_empty=False)
    assert summary.bad_acks == 1
    finished = [s for s in exported.get_finished_spans() if "messaging.message.id" in s.attributes]
    spans = {(s.kind, s.attributes["messaging.message.id"]): s for s in finished}
    applied, conflict = (s for s in finished if s.kind is SpanKind.SERVER)
    assert "asnackq.token" not in applied.attributes
    assert applied.attributes["asnackq.inbox.decision"] == "applied"
    assert conflict.attributes["asnackq.inbox.decision"] == "conflict"
    assert conflict.attributes["asnackq.token"] == 1
    assert conflict.attributes["http.response.status_code"] == 409
    assert conflict.context.trace_id == spans[SpanKind.CONSUMER, "x"].context.trace_id
    assert spans[SpanKind.CONSUMER, "x"].attributes["asnackq.result"] == "dead"
    assert spans[SpanKind.CONSUMER, "x"].attributes["asnackq.dead_reason"] == "permanent"
    unanswered = spans[SpanKind.CONSUMER, "y"]
    assert unanswered.attributes["asnackq.result"] == "unanswered"
    assert unanswered.attributes["asnackq.failure"] == "bad_acks"


async def test_in_the_applications_transaction_a_rollback_leaves_no_trace(exported, db):
    """``AsyncQueue.within``: the trace row commits or rolls back with the application's."""
    con = await aiosqlite.connect(db, isolation_level=None)
    try:
        queue = await AsyncQueue.within(con)
        for job_id, end in (("kept", "COMMIT"), ("gone", "ROLLBACK")):
            await con.execute("BEGIN IMMEDIATE")
            assert await queue.enqueue({"id": job_id, "qty": 1}) is True
            await con.execute(end)
    finally:
        await con.close()
    kept = next(
        s for s in exported.get_finished_spans() if s.attributes["messaging.message.id"] == "kept"
    )
    assert stored(db) == {"kept": traceparent(kept)}
