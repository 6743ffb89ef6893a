"""One worker for every endpoint (``asnackq.dispatch.fleet``): each endpoint's deliveries
go to it alone, with its own breaker, in-flight limit, rate and retry schedule; an endpoint
that never answers or answers 503 costs the others nothing and spends no attempts; a
disabled endpoint has nothing claimed until it is enabled; a change of its row takes
effect without a restart; ``asnackq work QUEUE`` runs it.  Real aiohttp receivers on
127.0.0.1 port 0 verify every request with the official Standard Webhooks library."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Fleet
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import Delays, Endpoint
from asnackq.dispatch.fleet import idle_ms_for
from asnackq.dispatch.port import LATE_SLOTS
from asnackq.http_sink import WebhookReceiver
from asnackq.wire import webhooks as wh

from .conftest import asnackq_cli, execute
from .sinks import peer, serving
from .test_endpoints import where as a_queue
from .test_event_deliveries import APPLIED, Hooks, apply, hooks, statuses
from .test_webhook_senders import SECRET, receiver

where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
FAST = w.Retry(5, 20)
WAIT_S = 60  # a bound on every wait: generous, for a busy machine


async def until(check: Callable[[], bool], what: str) -> None:
    """Return once ``check()`` holds (polled), failing after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(fleet: Fleet) -> AsyncIterator[asyncio.Future[Any]]:
    task = asyncio.ensure_future(fleet.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=2 * WAIT_S)
        if not task.done():  # a stop that does not end: say where every task waits
            stacks = io.StringIO()
            for each in asyncio.all_tasks():
                print(f"--- {each.get_name()}", file=stacks)
                each.print_stack(file=stacks)
            said = stacks.getvalue()
            raise AssertionError(f"the fleet did not stop within {2 * WAIT_S} s\n{said}")


class Timed(Hooks):
    """``Hooks`` that keep each verified request's arrival (monotonic seconds)."""

    def __init__(self, secret: str) -> None:
        super().__init__(secret)
        self.arrivals: list[float] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.monotonic())
        return await super().handle(request)


@contextlib.asynccontextmanager
async def timed(secret: str) -> AsyncIterator[tuple[Timed, str]]:
    receiver = Timed(secret)
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    async with serving(app) as server:
        yield receiver, f"{server.base}/hook"


@contextlib.asynccontextmanager
async def silent() -> AsyncIterator[str]:
    """A receiver that never answers: every request waits until the test ends."""
    gate = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        await gate.wait()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", handle)
    async with serving(app) as server:
        yield f"{server.base}/hook"
        gate.set()


def done_of(where: str, endpoint: str) -> int:
    return sum(s == ("done", endpoint) for s in statuses(where).values())


def attempts_of(where: str, endpoint: str) -> list[tuple[str, int]]:
    return sorted(
        execute(
            where,
            "SELECT j.status, j.attempts FROM asnackq_deliveries AS d JOIN jobs AS j"
            f" ON j.id = d.job WHERE d.endpoint = '{endpoint}'",
        )
    )


async def test_one_fleet_delivers_each_endpoints_deliveries_to_it_alone(where: str) -> None:
    one, two = wh.new_secret(), wh.new_secret()
    async with (
        hooks(one) as (orders, orders_url),
        hooks(two) as (users, users_url),
        AsyncQueue.open(where) as queue,
    ):
        await queue.add_endpoint(Endpoint("orders", orders_url, ("order.*",), (one,)))
        await queue.add_endpoint(Endpoint("users", users_url, ("user.*",), (two,), concurrency=2))
        await queue.enqueue_many(
            [{"id": f"o{i}", "type": "order.paid", "data": {"n": i}} for i in range(30)]
        )
        await queue.enqueue_many([{"id": f"u{i}", "type": "user.new", "data": i} for i in range(9)])
        summaries = await Fleet(queue, owner="fleet", retry=FAST).run(until_empty=True)
    assert (summaries["orders"].done, summaries["users"].done) == (30, 9)
    assert sorted(s.webhook_id for s in orders.seen) == sorted(f"o{i}" for i in range(30))
    assert sorted(s.webhook_id for s in users.seen) == sorted(f"u{i}" for i in range(9))
    assert (orders.refused, users.refused) == (0, 0)
    assert set(statuses(where).values()) == {("done", "orders"), ("done", "users")}


@pytest.mark.timeout(300)  # (each wait is bounded by WAIT_S: a busy machine, not a hang)
async def test_a_silent_and_a_503_endpoint_cost_the_healthy_one_nothing(tmp_path: Path) -> None:
    """The healthy endpoint's 60 deliveries all end done while one endpoint never answers
    and another answers 503: those two spend no attempt (each claimed delivery is held
    under its lease, at most its in-flight limit and the tickets kept ahead), none dies."""
    secret = wh.new_secret()
    where = str(tmp_path / "q.db")
    async with (
        hooks(secret) as (healthy, healthy_url),
        hooks(secret, 503) as (failing, failing_url),
        silent() as silent_url,
        AsyncQueue.open(where) as queue,
    ):
        await queue.add_endpoint(Endpoint("healthy", healthy_url, secrets=(secret,)))
        for name, url in (("failing", failing_url), ("silent", silent_url)):
            await queue.add_endpoint(
                Endpoint(name, url, secrets=(secret,), concurrency=2, timeout_s=0.2)
            )
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(60)])
        fleet = Fleet(queue, owner="fleet", retry=FAST, lease_ms=2000, prefetch=0)
        async with running(fleet):
            await until(lambda: done_of(where, "healthy") == 60, "every healthy delivery done")
            await until(
                lambda: all(fleet.dispatchers()[name].paused for name in ("failing", "silent")),
                "the two bad endpoints' breakers open",
            )
            paused = {name: d.paused for name, d in fleet.dispatchers().items()}
    assert sorted(s.webhook_id for s in healthy.seen) == sorted(f"e{i}" for i in range(60))
    assert paused == {"healthy": False, "failing": True, "silent": True}
    for name in ("failing", "silent"):
        held = attempts_of(where, name)
        claimed = [attempts for _, attempts in held if attempts]
        assert 1 <= len(claimed) <= 2 and set(claimed) == {1}  # its two slots, one attempt each
        assert {status for status, _ in held} <= {"pending", "leased"}
    assert len(failing.seen) >= 2  # it was asked, and answered 503


async def test_a_disabled_endpoint_has_nothing_claimed_until_it_is_enabled(where: str) -> None:
    secret = wh.new_secret()
    async with hooks(secret) as (partner, url), AsyncQueue.open(where) as queue:
        await queue.add_endpoint(Endpoint("partner", url, secrets=(secret,)))
        await queue.add_endpoint(Endpoint("other", url, secrets=(secret,)))
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(5)])
        await queue.disable_endpoint("partner", "maintenance")
        fleet = Fleet(queue, owner="fleet", retry=FAST, refresh_s=0.05)
        async with running(fleet):
            await until(lambda: done_of(where, "other") == 5, "the other endpoint's deliveries")
            assert set(fleet.dispatchers()) == {"other"}
            assert attempts_of(where, "partner") == [("pending", 0)] * 5  # none claimed
            await queue.enable_endpoint("partner")
            await until(lambda: done_of(where, "partner") == 5, "delivered once enabled")
    assert len(partner.seen) == 10


async def test_an_endpoints_schedule_and_rate_are_its_own(tmp_path: Path) -> None:
    """A list of delays longer than an hour is the delay a failed delivery waits; a rate
    paces its endpoint alone (its own rate row; the queue's untouched)."""
    secret = wh.new_secret()
    where = str(tmp_path / "q.db")
    async with (
        hooks(secret, 500) as (_, late_url),
        timed(secret) as (paced, paced_url),
        AsyncQueue.open(where) as queue,
    ):
        await queue.add_endpoint(
            Endpoint("late", late_url, secrets=(secret,), retry=Delays((7_200_000,)))
        )
        await queue.add_endpoint(Endpoint("paced", paced_url, secrets=(secret,), rate=20.0))
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(10)])
        before = w.epoch_ms()
        fleet = Fleet(queue, owner="fleet", retry=FAST, refresh_s=0.05)
        async with running(fleet):
            await until(lambda: done_of(where, "paced") == 10, "the paced endpoint's deliveries")
            await until(
                lambda: (
                    {s for s, _ in attempts_of(where, "late")} == {"pending"}
                    and all(a == 1 for _, a in attempts_of(where, "late"))
                ),
                "each late delivery failed once and waits",
            )
    arrivals = sorted(paced.arrivals)
    # 20 a second, bursts of one: ten sends span nine slots, less the lateness a first send
    # may have within its slot's bound (``port.LATE_SLOTS``); unpaced, they span milliseconds
    assert arrivals[-1] - arrivals[0] >= (9 - LATE_SLOTS) / 20 * 0.95
    waits = execute(
        where,
        "SELECT j.available_at FROM asnackq_deliveries AS d JOIN jobs AS j ON j.id = d.job"
        " WHERE d.endpoint = 'late'",
    )
    assert all(at >= before + 7_200_000 for (at,) in waits)  # the schedule's two hours
    keys = {key for (key,) in execute(where, "SELECT key FROM asnackq_rate")}
    assert keys == {"endpoint_" + lanes.lane_of("paced")}


async def test_a_change_of_an_endpoints_row_takes_effect_without_a_restart(where: str) -> None:
    secret = wh.new_secret()
    async with hooks(secret) as (partner, url), AsyncQueue.open(where) as queue:
        await queue.add_endpoint(Endpoint("partner", url, secrets=(secret,), concurrency=1))
        fleet = Fleet(queue, owner="fleet", retry=FAST, refresh_s=0.05)
        async with running(fleet):
            await until(lambda: "partner" in fleet.dispatchers(), "the endpoint's Dispatcher")
            first = fleet.dispatchers()["partner"]
            await queue.update_endpoint("partner", concurrency=3)
            await until(
                lambda: fleet.dispatchers().get("partner") not in (None, first),
                "a Dispatcher made with the new concurrency",
            )
            assert fleet.dispatchers()["partner"].settings.concurrency == 3
            await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(4)])
            fleet.wake()
            await until(lambda: done_of(where, "partner") == 4, "delivered by the new one")
            await queue.remove_endpoint("partner")
            await until(lambda: not fleet.dispatchers(), "no Dispatcher once removed")
    assert len(partner.seen) == 4


async def test_an_intake_on_the_fleets_queue_wakes_its_endpoints_lanes(tmp_path: Path) -> None:
    """Idle lanes that would look again only after a minute deliver an event published on
    the fleet's own queue at once: the intake names the endpoints it gave deliveries."""
    secret = wh.new_secret()
    where = str(tmp_path / "q.db")
    async with hooks(secret) as (partner, url), AsyncQueue.open(where) as queue:
        await queue.add_endpoint(Endpoint("partner", url, secrets=(secret,)))
        await queue.add_endpoint(Endpoint("idle", url, ("never.*",), (secret,)))
        fleet = Fleet(queue, owner="fleet", retry=FAST, idle_ms=60_000, refresh_s=60)
        async with running(fleet):
            await until(lambda: len(fleet.dispatchers()) == 2, "both endpoints' Dispatchers")
            await asyncio.sleep(0.2)  # (their first claims found nothing: idle for a minute)
            started = time.monotonic()
            await queue.publish({"id": "now", "data": 1})
            await until(lambda: done_of(where, "partner") == 1, "the event delivered")
            took = time.monotonic() - started
    assert took < 30  # not the minute's poll
    assert [s.webhook_id for s in partner.seen] == ["now"]


async def test_an_endpoint_this_worker_refuses_is_said_once_and_served_once_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A remote URL (this worker does not allow remote hosts) is refused once, in one log
    line, not at every refresh; its deliveries wait, and go once the row is changed."""
    secret = wh.new_secret()
    where = str(tmp_path / "q.db")
    async with hooks(secret) as (partner, url), AsyncQueue.open(where) as queue:
        await queue.add_endpoint(
            Endpoint("partner", "https://partner.example/hook", secrets=(secret,)),
            allow_remote=True,
        )
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(3)])
        fleet = Fleet(queue, owner="fleet", retry=FAST, refresh_s=0.02)
        async with running(fleet):
            await until(lambda: "partner" in fleet.refused, "the endpoint refused")
            await asyncio.sleep(0.3)  # (some fifteen refreshes)
            assert fleet.dispatchers() == {}
            assert attempts_of(where, "partner") == [("pending", 0)] * 3
            await queue.update_endpoint("partner", url=url)
            await until(lambda: done_of(where, "partner") == 3, "delivered once changed")
    said = [r.getMessage() for r in caplog.records if "not served" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and secret not in said[0]
    assert len(partner.seen) == 3


async def test_a_fleet_notes_each_endpoints_breaker_and_limit_while_it_serves(
    where: str,
) -> None:
    secret = wh.new_secret()
    async with (
        hooks(secret) as (_, url),
        silent() as silent_url,
        AsyncQueue.open(where) as queue,
    ):
        await queue.add_endpoint(Endpoint("ok", url, secrets=(secret,), concurrency=3))
        await queue.add_endpoint(
            Endpoint("silent", silent_url, secrets=(secret,), concurrency=2, timeout_s=0.2)
        )
        await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(20)])
        fleet = Fleet(queue, owner="noter", retry=FAST, refresh_s=0.05)
        notes = "SELECT endpoint, owner, breaker, limit_now FROM asnackq_endpoint_workers"

        def noted() -> set[tuple[Any, ...]]:
            try:
                return set(execute(where, notes))
            except Exception:  # (the table: made by the first note)
                return set()

        async with running(fleet):
            await until(
                lambda: noted() == {("ok", "noter", "closed", 3), ("silent", "noter", "open", 2)},
                "each endpoint noted, the silent one's breaker open",
            )
    assert noted() == set()  # a fleet that stops takes its notes back


class Held:
    """A receiver whose requests arrive (``arrived``) and wait for ``release``, then 204."""

    def __init__(self) -> None:
        self.arrived, self.release = asyncio.Event(), asyncio.Event()
        self.answered = 0

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived.set()
        await self.release.wait()
        self.answered += 1
        return web.Response(status=204)


def held_receivers(names: tuple[str, ...]) -> tuple[dict[str, Held], web.Application]:
    """A ``Held`` receiver per name, each at ``/name`` of one application."""
    held = {name: Held() for name in names}
    app = web.Application()
    for name in names:
        app.router.add_post(f"/{name}", held[name].handle)
    return held, app


async def test_a_fleet_that_stops_lets_every_endpoints_sends_in_flight_finish(
    tmp_path: Path,
) -> None:
    """Each endpoint's Dispatcher stops as a cancellation stops it: its sends in flight
    get their grace and their results are committed, the last endpoint's as the first's."""
    where, secret, names = str(tmp_path / "q.db"), wh.new_secret(), ("a", "b", "c")
    held, app = held_receivers(names)
    async with serving(app) as server, AsyncQueue.open(where) as queue:
        for name in names:
            url = f"{server.base}/{name}"
            await queue.add_endpoint(Endpoint(name, url, secrets=(secret,), concurrency=1))
        await queue.enqueue_many([{"id": "e1", "data": 1}])

        def stopped(name: str, dispatcher: object) -> None:
            for receiver in held.values():  # (the others' answers come once one stopped)
                receiver.release.set()

        fleet = Fleet(queue, owner="fleet", on_stop=stopped)
        task = asyncio.ensure_future(fleet.run())
        for receiver in held.values():
            await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        first = next(iter(fleet.dispatchers()))
        task.cancel()
        held[first].release.set()
        await asyncio.wait_for(asyncio.wait([task]), WAIT_S)
        left = still_running()  # (nothing of the run goes on past its end)
    assert left == []
    assert {name: summary.done for name, summary in fleet.summaries.items()} == dict.fromkeys(
        names, 1
    )
    assert [row for name in names for row in attempts_of(where, name)] == [("done", 1)] * 3


async def test_a_fleet_cancelled_twice_in_a_row_ends_every_endpoints_grace(
    tmp_path: Path,
) -> None:
    """A second cancellation that comes before the endpoints' Dispatchers took the first
    (two stop signals read at once) still ends their grace (an hour here) at once; the run
    still closes every endpoint's sends and ends its tasks."""
    where, names = str(tmp_path / "q.db"), ("a", "b")
    held, app = held_receivers(names)
    async with serving(app) as server, AsyncQueue.open(where) as queue:
        for name in names:
            await queue.add_endpoint(Endpoint(name, f"{server.base}/{name}", timeout_s=600))
        await queue.enqueue_many([{"id": "e1", "data": 1}])
        fleet = Fleet(queue, owner="fleet", grace_s=3600)
        task = asyncio.ensure_future(fleet.run())
        for receiver in held.values():
            await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        task.cancel()
        await asyncio.sleep(0)  # (the fleet takes it; its Dispatchers not yet)
        task.cancel()
        await asyncio.wait_for(asyncio.wait([task]), WAIT_S)
        left = still_running()
        for receiver in held.values():
            receiver.release.set()
    assert task.cancelled() and left == []
    assert {name: summary.done for name, summary in fleet.summaries.items()} == dict.fromkeys(
        names, 0
    )


def still_running() -> list[str]:
    """The product's coroutines whose tasks have not ended."""
    codes = [getattr(task.get_coro(), "cr_code", None) for task in asyncio.all_tasks()]
    return sorted(c.co_qualname for c in codes if c is not None and "/asnackq/" in c.co_filename)


def test_idle_lanes_poll_less_often_the_more_there_are() -> None:
    assert [idle_ms_for(n) for n in (0, 1, 8, 20, 100, 1000)] == [20, 20, 20, 50, 250, 500]


def test_a_fleet_refuses_bad_options_in_one_line(tmp_path: Path) -> None:
    async def main() -> list[str]:
        refused = []
        async with AsyncQueue.open(tmp_path / "q.db") as queue:
            for options in (
                {"refresh_s": 0},
                {"refresh_s": "1"},
                {"max_concurrency": 0},
                {"idle_ms": True},
                {"lease_ms": 0},
                {"owner": "a b"},
                {"on_start": 3},
            ):
                with pytest.raises(ValueError) as caught:
                    Fleet(queue, **options)
                refused.append(str(caught.value))
            with pytest.raises(ValueError, match="no lane"):
                Fleet(queue.in_lane(lanes.PLAIN))
        return refused

    refused = asyncio.run(main())
    assert all("\n" not in line and line for line in refused)


# --- the command line ---------------------------------------------------------------------


@pytest.mark.process
async def test_work_without_a_sink_serves_every_endpoint(tmp_path: Path) -> None:
    secret = wh.new_secret()
    where = str(tmp_path / "q.db")
    async with hooks(secret) as (a, a_url), hooks(secret) as (b, b_url):
        async with AsyncQueue.open(where) as queue:
            await queue.add_endpoint(Endpoint("a", a_url, ("x.*",), (secret,)))
            await queue.add_endpoint(Endpoint("b", b_url, secrets=(secret,)))
            await queue.enqueue_many(
                [{"id": f"e{i}", "type": "x.y" if i % 2 else "z", "data": i} for i in range(20)]
            )
        code, out, err = await asnackq_cli("work", where, "--until-empty", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert {name: c["done"] for name, c in result["endpoints"].items()} == {"a": 10, "b": 20}
    assert (len(a.seen), len(b.seen)) == (10, 20)


@pytest.mark.process
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--concurrency", "4"], "--concurrency"),
        (["--timeout-s", "3"], "--timeout-s"),
        (["--rate", "5"], "--rate"),
        (["--success", "2xx"], "--success"),
        (["--burst", "3"], "--burst"),
    ],
)
async def test_work_without_a_sink_refuses_what_the_rows_say(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    where = str(tmp_path / "q.db")
    async with AsyncQueue.open(where):
        pass
    code, out, err = await asnackq_cli("work", where, "--until-empty", *flags)
    assert code == 2 and out == ""
    assert named in err and "row says" in err and "Traceback" not in err


@pytest.mark.process
async def test_a_fleet_killed_mid_run_and_started_again_applies_every_event_once(
    tmp_path: Path,
) -> None:
    """Two receivers apply each webhook-id once in their own inbox; the fleet is SIGKILLed
    once some of the 2 x 40 deliveries are applied, and a fresh one finishes every one."""
    where, secret = str(tmp_path / "q.db"), wh.new_secret()
    cons = [await aiosqlite.connect(tmp_path / f"app{i}.db", isolation_level=None) for i in (0, 1)]
    try:
        async with contextlib.AsyncExitStack() as stack:
            urls, receivers = [], []
            for con in cons:
                await con.execute_fetchall(APPLIED)
                receiver = await WebhookReceiver.within(con, [secret], apply)
                app = web.Application()
                app.router.add_post("/hook", receiver.handle)
                server = await stack.enter_async_context(serving(app))
                urls.append(f"{server.base}/hook")
                receivers.append(receiver)
            async with AsyncQueue.open(where) as queue:
                for name, url in zip(("a", "b"), urls, strict=True):
                    await queue.add_endpoint(
                        Endpoint(name, url, secrets=(secret,), success="ack", concurrency=2)
                    )
                await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(40)])
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asnackq", "work", where, "--lease-ms", "1000",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            await until(lambda: sum(r.counts["applied"] for r in receivers) >= 10, "some applied")
            child.kill()
            await child.wait()
            code, _, err = await asnackq_cli("work", where, "--until-empty", "--json")
            assert code == 0, err
            applied = [
                [tuple(row) for row in await con.execute_fetchall("SELECT id FROM applied")]
                for con in cons
            ]
    finally:
        for con in cons:
            await con.close()
    for rows in applied:
        assert sorted(rows) == sorted((f"e{i}",) for i in range(40))  # each once
    assert set(statuses(where).values()) == {("done", "a"), ("done", "b")}


@pytest.mark.process
async def test_a_second_signal_ends_a_fleets_grace_and_it_still_closes_everything(
    tmp_path: Path,
) -> None:
    """SIGTERM stops claiming and gives sends in flight their grace; a second SIGTERM ends the
    grace at once, and the worker still closes its senders and ends every task of its own
    (nothing left for the interpreter to report)."""
    where = str(tmp_path / "q.db")
    arrived, gate = asyncio.Event(), asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        arrived.set()
        await gate.wait()  # never answers within the test
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", handle)
    async with serving(app) as server:
        async with AsyncQueue.open(where) as queue:
            await queue.add_endpoint(Endpoint("slow", f"{server.base}/hook", timeout_s=600))
            await queue.enqueue_many([{"id": f"e{i}", "data": i} for i in range(5)])
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-X", "dev", "-m", "asnackq", "work", where,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.wait_for(arrived.wait(), WAIT_S)
        child.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(child.communicate(), WAIT_S)
        gate.set()
    text = err.decode()
    assert "stopping" in text and "stopped" in text
    assert "timeout_s=600.0" in text  # the endpoint's own, said when its run starts
    for sign in ("Unclosed", "Task was destroyed", "Traceback", "never awaited"):
        assert sign not in text, text


@pytest.mark.timeout(180)
async def test_one_fleet_serves_an_http_server_receiver_beside_a_partner_taking_14_s(
    where: str,
) -> None:
    """Receivers the project did not write, side by side: Python's ``http.server`` verifying
    with the official library and answering 204, and an aiohttp partner taking 14 s an answer
    (within the 15 s default timeout). Every delivery is done at its first attempt, and the
    plain receiver has all of its deliveries before the partner's first answer."""
    plain_seen: list[int] = []  # at each of the partner's answers, what the plain one had

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(14)
        plain_seen.append(len(plain.seen))
        return web.Response(status=204)

    with receiver(SECRET) as plain:
        async with serving(peer(slow)) as partner, AsyncQueue.open(where) as queue:
            await queue.add_endpoint(Endpoint("plain", plain.url, secrets=(SECRET,)))
            await queue.add_endpoint(
                Endpoint("partner", partner.url, secrets=(SECRET,), concurrency=10)
            )
            await queue.enqueue_many([{"id": f"e{i}", "data": {"n": i}} for i in range(10)])
            fleet = Fleet(queue, owner="f")
            summaries = await asyncio.wait_for(fleet.run(until_empty=True), 150)
    assert {name: s.done for name, s in summaries.items()} == {"plain": 10, "partner": 10}
    assert (len(plain.seen), plain.refused) == (10, 0)  # each verified by the official library
    assert sorted(h["webhook-id"] for h in plain.seen) == sorted(f"e{i}" for i in range(10))
    assert len(plain_seen) == 10 and plain_seen[0] == 10  # the slow one held it up in nothing
    assert attempts_of(where, "plain") == [("done", 1)] * 10
    assert attempts_of(where, "partner") == [("done", 1)] * 10  # its leases kept for 14 s
