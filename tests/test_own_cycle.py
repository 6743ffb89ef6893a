"""``plan_cycle(..., own=True)``: a run's own tickets go unchecked; the plan is the same."""

from __future__ import annotations

import asyncio

import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms

from .conftest import T0, job, rows

LEASE = 5_000


def leased(path):
    """A queue of six jobs, five of them leased to w1 (tokens 1) at T0."""
    con = w.open_queue(path)
    for i in range(6):
        w.enqueue(con, {"id": f"j{i}", "qty": i + 1}, T0, 60_000, max_attempts=2)
    tickets = w.claim_many(con, "w1", T0, LEASE, 5)
    return con, tickets


def cycle_inputs(tickets):
    """Each kind of result: done, retried, dead (permanent), stale (a token the job never
    had), late (after its lease); and a lease to extend."""
    ok, retry, permanent, stale, late = tickets
    results = [
        (ok, "ok", T0 + 10, 0),
        (retry, "retry", T0 + 10, 30),
        (permanent, "permanent", T0 + 10, 0),
        ({**stale, "token": stale["token"] + 1}, "ok", T0 + 10, 0),
        (late, "ok", late["lease_until"], 0),
    ]
    return results, [stale]


@pytest.mark.parametrize("own", [False, True])
def test_own_cycle_lands_what_plan_cycle_lands(tmp_path, own):
    """The same inputs give the same result and the same rows with ``own`` as without, byte
    for byte: each finish and extension still meets its job's fence."""
    expected_path, path = tmp_path / "expected.db", tmp_path / "own.db"
    expected_con, expected_tickets = leased(expected_path)
    results, held = cycle_inputs(expected_tickets)
    expected = w.drive(
        expected_con, w.plan_cycle(results, held, "w2", T0 + 20, LEASE, 1, 1, limits=w.PRODUCT)
    )
    con, tickets = leased(path)
    results, held = cycle_inputs(tickets)
    cycle = w.plan_cycle(results, held, "w2", T0 + 20, LEASE, 1, 1, limits=w.PRODUCT, own=own)
    got = w.drive(con, cycle)
    assert got == expected
    statuses, extended, claimed, _ = got
    assert statuses == ["done", "pending", "dead", False, False]
    assert extended[0] is not False and extended[0]["lease_until"] == T0 + 20 + LEASE
    assert [ticket["id"] for ticket in claimed] == ["j5"]  # (one fresh; j1 waits its delay)
    assert rows(path) == rows(expected_path)
    assert job(path, "j3")["status"] == "leased" and job(path, "j4")["status"] == "leased"
    expected_con.close()
    con.close()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"outcome": "done"}, "outcome must be one of"),
        ({"outcome": None}, "outcome must be one of"),
        ({"now": -1}, "now_ms must be an int"),
        ({"now": float(T0)}, "now_ms must be an int"),
        ({"now": 10**15}, "now_ms must be an int"),
        ({"delay": True}, "delay_ms must be an int"),
        ({"delay": w.PRODUCT.delay_ms + 1}, "delay_ms must be an int"),
        ({"cycle_now": "now"}, "now_ms must be an int"),
        ({"lease": 0}, "lease_ms must be an int"),
        ({"lease": w.PRODUCT.lease_ms + 1}, "lease_ms must be an int"),
        ({"count": 1025}, "count must be an int"),
        ({"fresh": -1}, "fresh must be an int"),
        ({"owner": "two words"}, "owner must be 1-64 ASCII"),
    ],
)
def test_own_cycle_checks_every_input_but_the_tickets(tmp_path, change, says):
    """With ``own``, whatever is not a ticket is checked as without, with its message, before
    the plan reads anything: a bad input changes nothing."""
    con, tickets = leased(tmp_path / "q.db")
    before = rows(tmp_path / "q.db")
    result = (tickets[0], change.get("outcome", "ok"), change.get("now", T0 + 10), 0)
    result = (*result[:3], change.get("delay", 0))
    args = (
        [result],
        [tickets[1]],
        change.get("owner", "w1"),
        change.get("cycle_now", T0 + 10),
        change.get("lease", LEASE),
        change.get("count", 1),
        change.get("fresh", 0),
    )
    for own in (False, True):
        with pytest.raises(ValueError, match=says) as raised:
            w.plan_cycle(*args, limits=w.PRODUCT, own=own)
        assert "\n" not in str(raised.value)
    assert rows(tmp_path / "q.db") == before
    con.close()


@pytest.mark.parametrize("own", [1, "no", None])
def test_own_is_a_bool(tmp_path, own):
    """``own`` turns the ticket checks off: only a bool is taken for it."""
    con, tickets = leased(tmp_path / "q.db")
    result = ({"id": tickets[0]["id"]}, "ok", T0 + 10, 0)
    with pytest.raises(ValueError, match="own must be a bool"):
        w.plan_cycle([result], [], "w1", T0 + 10, LEASE, 0, limits=w.PRODUCT, own=own)
    con.close()


async def test_a_trace_that_changes_its_ticket_changes_no_delivery(tmp_path):
    """A Dispatcher's trace gets copies of the tickets, at the claim and at the finish: one
    that writes over them (a token, a lease) leaves the run's own tickets, which its cycles
    take unchecked, as they were: every job is done once, none finished stale."""
    db = tmp_path / "q.db"
    scribbled = []

    def trace(kind, ticket, at, status):
        ticket.update(token=999, lease_until=1, owner="someone-else")
        if kind == "claim":
            scribbled.append(ticket["id"])

    sent = []

    async def send(event, token):
        await asyncio.sleep(0)
        sent.append(token)
        return True

    async with AsyncQueue.open(db) as queue:
        now = epoch_ms()
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(40)], now)
        summary = await Dispatcher(queue, send, owner="d1", concurrency=8, trace=trace).run()
    assert sorted(scribbled) == sorted(f"j{i}" for i in range(40))
    assert sent == [1] * 40  # (each sent under the token it was claimed with)
    assert (summary.done, summary.stale, summary.claimed) == (40, 0, 40)
    assert {(row[1], row[3], row[6]) for row in rows(db) if len(row) > 3} == {
        (f"j{i}", "done", 1) for i in range(40)
    }
