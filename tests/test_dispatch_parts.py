"""The committer's loop-free parts: the ledger of held leases and the pacer of claims."""

from __future__ import annotations

import random

from asnackq.core import worker as w
from asnackq.dispatch.gate import Gate
from asnackq.dispatch.ledger import Due, Ledger
from asnackq.dispatch.pacer import AHEAD_FLOOR, ANY_S, Pacer, Want
from asnackq.dispatch.settings import Settings

LEASE = 1000


def ticket(job_id, token, until):
    return {"id": job_id, "token": token, "lease_until": until}


def settings(**changes):
    fields = {
        "owner": "w1",
        "concurrency": 8,
        "lease_ms": LEASE,
        "clock": w.epoch_ms,
        "jitter": random.random,
        "idle_ms": 20,
        "gather_ms": 10,
        "prefetch": None,
        "trace": None,
        "retry": w.RUN_ONCE_RETRY,
        "limits": w.Limits(),
    }
    return Settings(**(fields | changes))


def test_a_ledger_keeps_only_the_current_lease():
    ledger = Ledger(LEASE)
    held = ticket("a", "t1", 1000)
    ledger.hold([held])
    assert ledger.keeps(held, 999) and not ledger.keeps(held, 1000)
    assert not ledger.holds(ticket("a", "t0", 1000)), "an older token is not held"
    assert ledger.lease_until(held) == 1000
    ledger.release("a")
    assert not ledger and ledger.lease_until(held) is None and not ledger.keeps(held, 0)


def test_due_extends_at_half_a_lease_presses_returning_results_and_skips_capped_leases():
    ledger = Ledger(LEASE)
    for job_id, until in [("due", 500), ("later", 800), ("back", 400), ("cap", 450)]:
        ledger.hold([ticket(job_id, "t", until)])
    assert ledger.kept(0, [ticket("cap", "t", 450)], [ticket("cap", "t", 450)]) == 0
    due = ledger.due(0, {"back"})
    assert due == Due([ticket("due", "t", 500)], 300, True)
    stale = ledger.kept(0, due.tickets, [False])
    assert stale == 1 and not ledger.holds(ticket("due", "t", 500)), "a stale extension is lost"


def test_settled_jobs_leave_the_ledger_capped_or_not_and_a_new_lease_is_kept_again():
    """A cycle's settled jobs are let go at once, a lease capped at its deadline too: the
    same job claimed again later (a retry) is extended like any other."""
    ledger = Ledger(LEASE)
    ledger.hold([ticket("cap", "t1", 450), ticket("plain", "t1", 900), ticket("other", "t1", 900)])
    assert ledger.kept(0, [ticket("cap", "t1", 450)], [ticket("cap", "t1", 450)]) == 0
    ledger.settled([ticket("cap", "t1", 450), ticket("plain", "t1", 900)])
    assert not ledger.holds(ticket("cap", "t1", 450)) and not ledger.holds(ticket("plain", "t1", 0))
    assert ledger.holds(ticket("other", "t1", 900)), "only the settled ones are let go"
    ledger.hold([ticket("cap", "t2", 400)])  # claimed again, with a new token
    assert ledger.due(0, set()).tickets == [ticket("cap", "t2", 400)], "no longer capped"


def test_the_hundredth_cycle_still_keeps_every_held_lease():
    rng = random.Random(24)
    ledger, now, deadline = Ledger(LEASE), 0, 30_000
    for i in range(20):
        ledger.hold([ticket(f"job-{i}", "t", LEASE)])
    for _ in range(200):
        now += rng.randrange(1, LEASE // 2)  # cycles at least every half a lease
        for i in range(20):  # no lease lapsed since the last cycle
            assert ledger.keeps(ticket(f"job-{i}", "t", 0), now) or now >= deadline, (now, i)
        due = ledger.due(now, set())
        extended = [ticket(t["id"], "t", min(now + LEASE, deadline)) for t in due.tickets]
        assert ledger.kept(now, due.tickets, extended) == 0


def test_a_pacer_claims_for_waiters_and_ahead_within_the_budget():
    pacer = Pacer(settings(prefetch=5), lambda: 0.0)
    assert pacer.want(waiting=3, ready=2, budget=None) == Want(3, 3)
    assert pacer.want(waiting=3, ready=2, budget=4) == Want(3, 1)
    assert Pacer(settings(), lambda: 0.0).ahead() == 2, "a quarter of the concurrency at least"


def taking(pacer, now, tickets, seconds):
    """``pacer``'s coroutines took ``tickets`` over a cycle of ``seconds`` (clock ``now``)."""
    pacer.begin()
    for _ in range(tickets):
        pacer.took()
    now[0] += seconds
    pacer.begin()


async def test_tickets_ahead_outlast_a_gathering_however_few_the_sends_in_flight():
    """Twice what the coroutines take during a gathering (10 ms here) is kept ahead: at one
    send in flight, beyond eight per send, up to ``AHEAD_FLOOR``; with a gate (concurrency
    "auto": its holders wait instead) no more than a quarter of the concurrency."""
    now = [0.0]
    one = Pacer(settings(concurrency=1), lambda: now[0])
    taking(one, now, 10, 0.01)  # 1,000 a second: 20 in two gatherings
    assert one.ahead() == 20
    taking(one, now, 100, 0.01)
    assert one.ahead() == AHEAD_FLOOR > 8
    many = Pacer(settings(concurrency=16), lambda: now[0])
    taking(many, now, 1000, 0.01)
    assert many.ahead() == 8 * 16 > AHEAD_FLOOR
    gate = Gate(64)
    gated = Pacer(settings(concurrency=64), lambda: now[0], gate)
    taking(gated, now, 1000, 0.01)
    assert gated.ahead() == gate.limit // 4 < 64


def test_while_no_coroutine_waits_one_ticket_ahead_a_second_is_of_any_job():
    now = [100.0]
    pacer = Pacer(settings(prefetch=5), lambda: now[0])
    pacer.found(Want(0, 4), 4)  # (jobs never attempted keep every coroutine busy)
    assert pacer.want(waiting=0, ready=1, budget=None) == Want(0, 4)
    now[0] += ANY_S
    assert pacer.want(waiting=0, ready=1, budget=None) == Want(1, 3, True)
    assert pacer.want(waiting=0, ready=5, budget=None) == Want(0, 0)  # (none wanted)
    assert pacer.want(waiting=2, ready=0, budget=None) == Want(2, 5)  # (waiters claim any)
    pacer.found(Want(2, 5), 7)
    assert pacer.want(waiting=0, ready=1, budget=None) == Want(0, 4)  # (a second from now)
    now[0] += ANY_S
    pacer.found(Want(1, 3, True), 4)
    assert pacer.want(waiting=0, ready=1, budget=None) == Want(0, 4)
    now[0] += ANY_S
    pacer.found(Want(0, 4), 2)  # (they ran short: coroutines come free and wait)
    pacer.poll_again()
    assert pacer.want(waiting=0, ready=1, budget=None) == Want(0, 4)


def test_a_claim_of_any_job_ahead_is_governed_by_the_claims_ahead():
    """The one ticket ahead claimed as any job is a claim ahead: a claim for waiting
    coroutines that came up short does not hold it back, and its job poisoned (one short)
    does not stop the claims ahead."""
    now = [100.0]
    pacer = Pacer(settings(prefetch=2), lambda: now[0])
    pacer.found(Want(0, 2), 2)  # (jobs never attempted keep every coroutine busy)
    pacer.found(Want(2, 0), 1)  # (a claim for waiting coroutines came up short)
    now[0] += ANY_S
    want = pacer.want(waiting=0, ready=1, budget=None)
    assert want == Want(1, 0, True) and pacer.claims(want)
    now[0] += ANY_S
    pacer.found(Want(1, 3, True), 3)  # (one short: its job poisoned)
    assert pacer.claims(Want(0, 4)) and pacer.idle_wake(None) == 20  # (dry: the earlier claim)
    now[0] += ANY_S
    pacer.found(Want(1, 3, True), 2)  # (two short: the jobs never attempted ran out)
    assert not pacer.claims(Want(0, 4))
    assert pacer.want(waiting=0, ready=1, budget=None) == Want(0, 1)  # (no backlog)


def test_a_dry_claim_waits_for_the_idle_poll():
    pacer = Pacer(settings(), lambda: 0.0)
    pacer.found(Want(2, 0), 1)
    assert not pacer.claims(Want(1, 0)) and pacer.claims(Want(0, 1))
    assert pacer.idle_wake(None) == 20 and pacer.idle_wake(5) == 5
    pacer.poll_again()
    assert pacer.claims(Want(1, 0)) and pacer.idle_wake(None) is None


def test_results_gather_from_the_last_cycle_never_past_a_lease_due():
    now = [100.0]
    pacer = Pacer(settings(gather_ms=50), lambda: now[0])
    started = pacer.begin()
    now[0] += 0.02
    pacer.end(started)
    assert abs(pacer.txn_s - 0.02) < 1e-9
    assert abs(pacer.pause(False, None) - 0.03) < 1e-9
    assert abs(pacer.pause(False, 10) - 0.01) < 1e-9
    assert pacer.pause(True, None) == 0.0
