"""Pacing to the sink: a sink's capacity, 429/Retry-After honoured, adaptive concurrency."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import time

import aiohttp
import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher, Summary
from asnackq.cli.render import progress_line
from asnackq.core.worker import Overloaded, Retry, epoch_ms
from asnackq.dispatch.adaptive import CUBIC, DECREASE, Aimd
from asnackq.dispatch.gate import Gate, depth
from asnackq.http_sink import CAPACITY
from asnackq.sink.capacity import Capacity
from asnackq.wire.send import RETRY_AFTER_MAX_S, AsyncHttpSender, retry_after

from .conftest import rows
from .sequencer import until
from .sinks import peer, serving, sink, sink_state


@pytest.fixture
async def queue(db):
    async with AsyncQueue.open(db) as opened:
        yield opened


async def fill(queue, count, ttl=60_000):
    await queue.enqueue_many(
        [({"id": f"job-{i}", "qty": 1}, ttl, 3) for i in range(count)], epoch_ms()
    )


# --- Retry-After --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        (None, None),
        ("3", 3.0),
        (" 0 ", 0.0),
        ("86400", RETRY_AFTER_MAX_S),
        ("9" * 5000, RETRY_AFTER_MAX_S),
        ("-1", None),
        ("1.5", None),
        ("soon", None),
        ("", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # in the past: at once
        ("Thu, 01 Jan 1970 00:00:10 GMT", 0.0),
    ],
)
def test_retry_after_is_delta_seconds_or_an_http_date_capped(header, seconds):
    assert retry_after(header) == seconds


def test_retry_after_as_an_http_date_counts_from_now():
    assert retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now_s=60.0) == 40.0
    assert retry_after("Thu, 01 Jan 1970 00:01:40 +0000", now_s=60.0) == 40.0
    header = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= retry_after(header) <= 30


# --- the sink's capacity ----------------------------------------------------------------


def test_capacity_admits_up_to_n_in_flight_then_a_token_a_rate():
    now = [0.0]
    capacity = Capacity(max_inflight=2, max_rate=20, clock=lambda: now[0], service_s=1.5)
    assert [capacity.admit(), capacity.admit(), capacity.admit()] == [None, None, 1]
    capacity.done()
    assert capacity.admit() == 1  # the bucket (two tokens: a tenth of 20/s) is empty
    now[0] = 0.05
    assert capacity.admit() is None
    assert (capacity.inflight, capacity.peak) == (2, 2)


def test_past_its_in_flight_count_a_sink_asks_for_its_service_time_rounded_down():
    """A slot frees within the service time: a service under a second asks for no wait
    (``Retry-After: 0``, the header's whole seconds cannot say 20 ms), never for one second
    fifty times too long."""
    for service_s, asked in ((0.0, 0), (0.02, 0), (0.999, 0), (1.0, 1), (2.5, 2)):
        capacity = Capacity(max_inflight=1, service_s=service_s)
        assert (capacity.admit(), capacity.admit()) == (None, asked)


@pytest.mark.parametrize(
    "options", [{"max_inflight": 0}, {"max_inflight": True}, {"max_rate": 0}, {"max_rate": "1"}]
)
def test_capacity_values_are_checked(options):
    with pytest.raises(ValueError, match="max_"):
        Capacity(**options)


async def post(session, url, event_id):
    async with session.post(url, json={"id": event_id, "qty": 1}) as answer:
        return answer.status, answer.headers.get("Retry-After")


async def test_a_sink_past_its_in_flight_capacity_answers_429_and_changes_nothing(tmp_path):
    sink_db = tmp_path / "sink.db"
    async with (
        sink(sink_db, max_inflight=2, delay_ms=300) as running,
        aiohttp.ClientSession() as session,
    ):
        answers = await asyncio.gather(*(post(session, running.url, f"e{i}") for i in range(6)))
        async with session.get(f"{running.base}/stats") as got:
            stats = await got.json()
        async with session.get(f"{running.base}/metrics") as got:
            metrics = await got.text()
    assert sorted(answers) == [(200, None)] * 2 + [(429, "0")] * 4  # (a slot in 0.3 s)
    assert (stats["overloaded"], stats["applied"], stats["inflight_peak"]) == (4, 2, 2)
    assert stats["inflight"] == 0
    assert "asnackq_sink_overloaded_total 4" in metrics
    assert "asnackq_sink_inflight 0" in metrics
    total, inbox = sink_state(sink_db)
    assert (total, len(inbox)) == (2, 2)


async def test_a_sink_past_its_rate_answers_429_with_retry_after(tmp_path):
    sink_db = tmp_path / "sink.db"
    async with sink(sink_db, max_rate=2) as running, aiohttp.ClientSession() as session:
        answers = [await post(session, running.url, f"e{i}") for i in range(4)]
    assert answers[0] == (200, None)
    assert answers[1:] == [(429, "1")] * 3  # a burst of one: the bucket holds 1 token
    assert len(sink_state(sink_db)[1]) == 1


async def test_an_event_is_in_service_from_admission_to_answer_its_commit_within_the_delay(
    tmp_path,
):
    """With a delay of 1 s the inbox row is committed while the event is still in service
    (counted in flight, unanswered at 0.6 s), and the answer comes no earlier than the delay
    after admission."""
    sink_db = tmp_path / "sink.db"
    async with (
        sink(sink_db, max_inflight=4, delay_ms=1000) as running,
        aiohttp.ClientSession() as session,
    ):
        started = time.monotonic()
        posting = asyncio.ensure_future(post(session, running.url, "e1"))
        answered, _ = await asyncio.wait([posting], timeout=0.6)
        committed, in_service = sink_state(sink_db)[1], running.app[CAPACITY].inflight
        assert await posting == (200, None)
        answered_s = time.monotonic() - started
        assert running.app[CAPACITY].inflight == 0
    assert not answered and committed and in_service == 1
    assert answered_s >= 1.0


# --- 429 and Retry-After honoured by the Dispatcher ---------------------------------------


def overloaded_first(times, status=429, header=None, clock=time.monotonic):
    """A peer answering ``status`` (with ``header`` as Retry-After) ``times`` times for each
    id, then ACKing; it keeps each request's arrival time by ``clock``."""
    seen: dict[str, list[float]] = {}

    async def handler(request):
        body = await request.json()
        arrivals = seen.setdefault(body["id"], [])
        arrivals.append(clock())
        if len(arrivals) <= times:
            headers = {} if header is None else {"Retry-After": header}
            return web.json_response({"status": "busy"}, status=status, headers=headers)
        return web.json_response({"id": body["id"], "status": "applied"})

    return peer(handler), seen


@pytest.mark.parametrize(
    ("status", "header", "least_s"),
    [
        (429, None, 0.0),
        (429, "1", 1.0),
        (429, "soon", 0.0),
        (503, "1", 1.0),
        (429, "http-date", 1.0),
    ],
)
async def test_an_overload_spends_no_attempt_and_waits_as_asked(queue, db, status, header, least_s):
    dated = header == "http-date"
    if dated:  # a wall-clock instant at whole seconds, one to two seconds ahead
        until = float(int(time.time()) + 2)
        header = email.utils.formatdate(until, usegmt=True)
    app, seen = overloaded_first(2, status, header, time.time if dated else time.monotonic)
    await fill(queue, 3)
    async with serving(app) as running, AsyncHttpSender(running.url, timeout_s=0.5) as send:
        summary = await Dispatcher(queue, send, owner="d1", concurrency=3, lease_ms=1000).run()
    assert (summary.done, summary.overloaded, summary.requests) == (3, 6, 9)
    assert (summary.retried, summary.dead, summary.outages) == (0, 0, 0)
    assert {(r[3], r[4]) for r in rows(db) if len(r) > 3} == {("done", 1)}  # one attempt each
    for arrivals in seen.values():
        if dated:  # no second request before the date (once passed, it asks for no wait)
            assert arrivals[1] >= until - 0.01  # (the loop's rounding)
            continue
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        assert min(gaps) >= least_s * 0.99  # (the loop's rounding)


async def test_an_overload_asking_no_wait_is_paced_by_the_retry_policy(queue, db):
    """``Retry-After: 0`` (a slot frees within a second) is no licence to send again at
    once: with a fixed concurrency the retry policy's delays pace the sends (100 ms, then
    200 ms at jitter 0.5 over a base of 200 ms)."""
    app, seen = overloaded_first(2, 429, "0")
    await fill(queue, 2)
    async with serving(app) as running, AsyncHttpSender(running.url, timeout_s=0.5) as send:
        summary = await Dispatcher(
            queue,
            send,
            owner="d1",
            concurrency=2,
            lease_ms=2000,
            jitter=lambda: 0.5,
            retry=Retry(200, 1000),
        ).run()
    assert (summary.done, summary.overloaded, summary.retried) == (2, 4, 0)
    for arrivals in seen.values():
        first, second = (later - earlier for earlier, later in itertools.pairwise(arrivals))
        assert first >= 0.099 and second >= 0.199


async def warmed(queue, send, max_jobs, **options):
    """A Dispatcher with concurrency "auto" following ``queue`` (jitter 0.5), returned with
    its run once a first job is done: the latency floor is learnt."""
    finished = asyncio.Event()
    dispatcher = Dispatcher(
        queue,
        send,
        owner="d1",
        concurrency="auto",
        lease_ms=5000,
        jitter=lambda: 0.5,
        trace=lambda kind, ticket, now_ms, status: kind == "finish" and finished.set(),
        **options,
    )
    run = asyncio.ensure_future(dispatcher.run(follow=True, max_jobs=max_jobs))
    await asyncio.wait_for(finished.wait(), 10)
    return dispatcher, run


async def test_under_auto_an_overload_asking_no_wait_waits_one_latency_floor(queue):
    """Under concurrency "auto" a ``Retry-After: 0`` is sent again after the sink's quickest
    answer so far (here 60 ms, times 0.5 + 0.5 at jitter 0.5), not after the retry policy's
    delay (2 s at that jitter)."""
    seen: dict[str, list[float]] = {}

    async def handler(request):
        body = await request.json()
        arrivals = seen.setdefault(body["id"], [])
        arrivals.append(time.monotonic())
        if body["id"] != "job-0" and len(arrivals) == 1:
            return web.json_response({"status": "busy"}, status=429, headers={"Retry-After": "0"})
        await asyncio.sleep(0.06)
        return web.json_response({"id": body["id"], "status": "applied"})

    await queue.enqueue({"id": "job-0", "qty": 1}, epoch_ms(), 60_000, 3)
    async with serving(peer(handler)) as running, AsyncHttpSender(running.url) as send:
        _, run = await warmed(queue, send, 4, max_concurrency=4, retry=Retry(4000, 4000))
        await fill(queue, 4)  # (job-0 is there already)
        summary = await asyncio.wait_for(run, 10)
    assert (summary.done, summary.overloaded) == (4, 3)
    for job_id in ("job-1", "job-2", "job-3"):
        (gap,) = (later - earlier for earlier, later in itertools.pairwise(seen[job_id]))
        assert 0.055 <= gap < 1.0, (job_id, gap)


async def test_an_overload_never_outlasts_the_job_s_deadline(queue, db):
    app, seen = overloaded_first(100, 429, "30")
    await fill(queue, 2, ttl=700)
    started = time.monotonic()
    async with serving(app) as running, AsyncHttpSender(running.url, timeout_s=0.2) as send:
        summary = await Dispatcher(queue, send, owner="d1", concurrency=2, lease_ms=300).run()
    assert time.monotonic() - started < 10  # not the 30 s asked for
    assert (summary.done, summary.dead_deadline, summary.overloaded) == (0, 2, 2)
    assert {(r[3], r[11]) for r in rows(db) if len(r) > 3} == {("dead", "deadline")}
    assert all(len(arrivals) == 1 for arrivals in seen.values())


# --- adaptive concurrency ----------------------------------------------------------------


def test_slow_start_doubles_then_an_overload_cuts_once_per_round_trip():
    now = [0.0]
    rule = Aimd(64, lambda: now[0])
    for _ in range(7):
        rule.observe(now[0], 0.01, "ok", rule.limit)
    assert rule.limit == 8
    now[0] = 1.0
    rule.observe(0.99, 0.01, "overload", 8)
    rule.observe(0.99, 0.01, "overload", 8)  # began before the cut: no second cut
    assert (rule.limit, rule.cuts) == (int(8 * DECREASE), 1)
    rule.observe(1.01, 0.01, "failure", 6)
    assert rule.cuts == 2


def test_after_a_cut_the_limit_follows_the_cubic_curve_back_to_a_plateau_then_past_it():
    """Cut from 10 to 8: the curve is back at 10 after k = cbrt(2 / CUBIC) s (1.71 s), flat
    around it for a while (one probe past a known limit in about k seconds), then steeper;
    growth never goes faster than one slot per round trip, and needs the limit in use."""
    now = [0.0]
    rule = Aimd(64, lambda: now[0], initial=10)
    rule.observe(0.0, 0.01, "overload", 10)
    assert (rule.limit, rule.w_max) == (8, 10.0)
    k = (2 / CUBIC) ** (1 / 3)
    assert rule.k_s == pytest.approx(k)

    def round_trips(at, count, in_flight=None):
        now[0] = at
        for _ in range(count):
            for _ in range(rule.limit):
                rule.observe(at, 0.01, "ok", rule.limit if in_flight is None else in_flight)

    round_trips(0.0, 50)
    assert rule.limit == 8  # the curve starts at the cut
    round_trips(k / 2, 50)
    assert 9.0 < rule.value < 10.0  # most of the way back, quickly
    round_trips(k + 0.5, 50)
    assert 10.0 <= rule.value < 10.1  # the plateau: no probe past 10 yet
    round_trips(k + 3.0, 3)
    assert rule.value <= 10.1 + 3  # past the plateau: at most one slot per round trip
    before = rule.value
    round_trips(k + 10.0, 50, in_flight=1)
    assert rule.value == before  # the limit not in use: no growth


def test_latency_rising_past_the_floor_cuts_the_limit():
    now = [0.0]
    rule = Aimd(64, lambda: now[0], initial=16)
    for _ in range(20):
        rule.observe(0.0, 0.010, "ok", 16)
    before = rule.limit
    for i in range(20):
        now[0] = 1.0 + i
        rule.observe(now[0], 0.050, "ok", 16)  # five times the floor
    assert rule.limit < before and rule.cuts >= 1


def test_the_limit_stays_within_its_bounds():
    with pytest.raises(ValueError, match="min_limit"):
        Aimd(4, time.monotonic, initial=5)
    now = [0.0]
    rule = Aimd(3, lambda: now[0])
    for _ in range(10):
        rule.observe(0.0, 0.01, "ok", 3)
    assert rule.limit == 3
    for i in range(50):
        now[0] = i + 1.0
        rule.observe(now[0], 0.01, "overload", 1)
    assert rule.limit == 1


async def test_the_gate_holds_sends_to_the_limit_and_tickets_to_the_limit_and_a_short_line():
    """Ten coroutines behind a gate whose limit is 4: never more than 4 sends at once, never
    more than 4 + depth(4) = 6 holding a ticket; every one gets through."""
    gate = Gate(64)
    gate.rule.value = 4.0
    gate.rule.slow_start = False
    gate.rule.cut_at = asyncio.get_running_loop().time()  # (no growth: the curve is flat)
    gate.rule.w_max = 4.0
    sending = holding = most_sending = most_holding = 0
    done: list[int] = []

    async def send(event, token):
        nonlocal sending, most_sending
        sending += 1
        most_sending = max(most_sending, sending)
        await asyncio.sleep(0.02)
        sending -= 1
        return True

    async def coroutine(i):
        nonlocal holding, most_holding
        for _ in range(3):
            await gate.acquire()
            holding += 1
            most_holding = max(most_holding, holding)
            await asyncio.sleep(0.005)  # (taking a ticket)
            await gate.send(send, {"id": f"e{i}"}, 1)
            holding -= 1
            gate.release()
        done.append(i)

    await asyncio.wait_for(asyncio.gather(*(coroutine(i) for i in range(10))), 10)
    assert depth(4) == 2 and (most_sending, most_holding) == (4, 6)
    assert sorted(done) == list(range(10)) and gate.holders.taken == gate.sends.taken == 0


async def test_auto_concurrency_finds_a_capacity_limited_sink_s_capacity(queue, db, tmp_path):
    await fill(queue, 400)
    sink_db = tmp_path / "sink.db"
    async with sink(sink_db, max_inflight=6, delay_ms=20) as running:
        async with AsyncHttpSender(running.url) as send:
            dispatcher = Dispatcher(
                queue, send, owner="d1", concurrency="auto", max_concurrency=64, lease_ms=5000
            )
            summary = await asyncio.wait_for(dispatcher.run(), 60)
        peak = running.app[CAPACITY].peak
    assert (summary.done, summary.dead, summary.retried) == (400, 0, 0)
    assert summary.overloaded < 0.1 * summary.requests  # a few probes past capacity
    assert 2 <= summary.concurrency <= 12  # near the sink's 6
    assert 4 <= peak <= 6  # the sink was kept near its capacity, never past it
    assert len(sink_state(sink_db)[1]) == 400


def test_the_progress_line_shows_429s_and_the_limit():
    counts = {**Summary().as_dict(), "overloaded": 3, "concurrency": 7}
    line = progress_line(counts, 1.0, paused=False)
    assert "429s 3" in line and "in flight <= 7" in line
    assert "429s" not in progress_line(Summary().as_dict(), 1.0, paused=False)


async def test_concurrency_auto_is_checked(queue):
    async def send(event, token):
        return True

    with pytest.raises(ValueError, match="concurrency"):
        Dispatcher(queue, send, owner="d1", concurrency="max")
    with pytest.raises(ValueError, match="max_concurrency"):
        Dispatcher(queue, send, owner="d1", concurrency="auto", max_concurrency=0)


async def test_a_run_stopped_while_its_jobs_wait_out_an_overload_ends_within_its_grace(queue, db):
    """Under "auto" the tickets the gate lets be held (limit 1: two) wait out 30 s each,
    keeping their places (the other two jobs are not claimed); a stop ends the run within
    its grace, the waiting jobs left leased."""
    app, seen = overloaded_first(100, 429, "30")
    await fill(queue, 4)
    waiting, overloads = asyncio.Event(), []

    async with serving(app) as running, AsyncHttpSender(running.url, timeout_s=0.5) as http:

        async def send(event, token):
            try:
                return await http(event, token)
            except Overloaded:
                overloads.append(event["id"])
                if len(overloads) == 2:  # both held tickets wait out their 30 s
                    waiting.set()
                raise

        dispatcher = Dispatcher(
            queue, send, owner="d1", concurrency="auto", lease_ms=1000, grace_s=0.2
        )
        run = asyncio.ensure_future(dispatcher.run(follow=True))
        async with asyncio.timeout(30):
            await waiting.wait()
        run.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert time.monotonic() - started < 5
    assert dispatcher.summary.overloaded == 2 and dispatcher.summary.done == 0
    states = sorted((r[3], r[4]) for r in rows(db) if len(r) > 3)
    assert states == [("leased", 1)] * 2 + [("pending", 0)] * 2  # left to the lease
    assert all(len(arrivals) == 1 for arrivals in seen.values())


async def test_under_auto_a_sink_answering_429_zero_forever_is_not_sent_to_in_a_tight_loop(db):
    """One quick ACK (the latency floor: about a millisecond), then ``429`` with
    ``Retry-After: 0`` for ever: under concurrency "auto" the wait before each re-send
    doubles per overload of the ticket, so the sink is not sent to in a tight loop (a wait
    of one floor every time: about 700 requests a second)."""
    refused = 0

    async def handler(request):
        nonlocal refused
        body = await request.json()
        if body["id"] == "warm":
            return web.json_response({"id": "warm", "status": "applied"})
        refused += 1
        return web.json_response({"status": "busy"}, status=429, headers={"Retry-After": "0"})

    async with AsyncQueue.open(db) as queue:
        await queue.enqueue({"id": "warm", "qty": 1}, epoch_ms(), 600_000, 3)
        async with serving(peer(handler)) as running, AsyncHttpSender(running.url) as send:
            _, run = await warmed(queue, send, None, max_concurrency=16, grace_s=0.1)
            try:
                await queue.enqueue_many(
                    [({"id": f"job-{i}", "qty": 1}, 600_000, 3) for i in range(8)], epoch_ms()
                )
                await until(lambda: refused >= 8, 60)  # claimed, first refusals
                before, began = refused, asyncio.get_running_loop().time()
                await asyncio.sleep(1.0)  # (a busy machine only lowers the rate measured)
                per_s = (refused - before) / (asyncio.get_running_loop().time() - began)
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
    assert per_s <= 100, f"{per_s} requests in one second to a sink refusing every one"


async def test_under_auto_tickets_waiting_out_retry_after_do_not_exceed_the_gate_s_bound(
    db, tmp_path
):
    """A sink refusing quickly with ``Retry-After: 1`` (``--max-rate 5``): a ticket waiting
    out its second keeps its holder's place, so no more tickets are held than the gate's
    bound (were the place given back, every one of the 64 coroutines would claim a ticket
    and be refused in turn: a herd of requests, nearly all 429s)."""
    async with AsyncQueue.open(db) as queue:
        await queue.enqueue_many(
            [({"id": f"job-{i}", "qty": 1}, 600_000, 3) for i in range(120)], epoch_ms()
        )
        async with (
            sink(tmp_path / "sink.db", max_rate=5) as running,
            AsyncHttpSender(running.url) as send,
        ):
            dispatcher = Dispatcher(
                queue,
                send,
                owner="d1",
                concurrency="auto",
                max_concurrency=64,
                lease_ms=5000,
                grace_s=0.1,
            )
            run = asyncio.ensure_future(dispatcher.run(follow=True))
            await until(lambda: dispatcher.snapshot()["overloaded"] >= 15, 60)  # (a herd: 64)
            counts = dispatcher.snapshot()
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    held = counts["claimed"] - counts["done"]
    limit = counts["concurrency"]
    assert held <= limit + depth(limit) + 2, (held, limit, counts["overloaded"])


async def test_a_stopped_auto_run_s_summary_has_the_limit_not_max_concurrency(db, tmp_path):
    """``work`` follows the queue until a signal stops it: the cancelled run's summary has
    the adaptive limit as its concurrency, not ``max_concurrency``."""
    async with AsyncQueue.open(db) as queue:
        await queue.enqueue_many(
            [({"id": f"job-{i}", "qty": 1}, 600_000, 3) for i in range(20)], epoch_ms()
        )
        async with (
            sink(tmp_path / "sink.db", max_inflight=2, delay_ms=10) as running,
            AsyncHttpSender(running.url) as send,
        ):
            dispatcher, run = await warmed(queue, send, None, max_concurrency=64)
            limit = dispatcher.snapshot()["concurrency"]
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    assert limit < 64
    assert dispatcher.summary.concurrency < 64, dispatcher.summary.concurrency
