"""PostgreSQL: a session's claims walk from floors (``asnackq.store.pg_walks``): past the
dead index entries a held snapshot keeps, with every job behind a floor found by the next
walk from the front."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.store import pg, pg_session, pg_sql
from asnackq.store.pg_session import SCOUT_CLOSE_S, SCOUT_NAME
from asnackq.store.pg_sql import STATEMENTS
from asnackq.store.pg_walks import (
    FLOORED,
    FULL_S,
    LOWEST,
    MOST_S,
    SCOUT_S,
    SCOUT_WAIT_S,
    SCOUTED,
    Walks,
)

from . import pgdb
from .conftest import T0
from .pgdb import done_statistics, ended, executed_plan, query
from .sequencer import until

FRESH, NEXT, DUE = (
    w.SQL_NEXT_FRESH_RECLAIMING,
    w.SQL_NEXT_RECLAIMABLE,
    w.SQL_QUARANTINE_DUE_RECLAIMING,
)
LEASE = 60_000


class Ticking:
    """A clock for the walks' schedule that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def row(seq: int, reclaim: bool = False) -> tuple[Any, ...]:
    return (seq, f"j{seq}", 1, 0, 0, T0 + LEASE, reclaim, 0)


def walk(walks: Walks, sql: str, params: dict[str, Any], rows: list[tuple[Any, ...]]):
    """One statement's walk, in a transaction of its own: the floors it was given."""
    walks.begin()
    floored = walks.floored(sql, params)
    assert floored is not None
    walks.found(sql, floored[1], rows)
    return floored[1]["from_seq"], floored[1]["from_time"]


# --- the rules, on their own ---------------------------------------------------------


def test_a_full_claim_moves_the_floor_to_its_first_job_and_a_short_one_back_to_the_front():
    walks = Walks(Ticking())
    fresh = {"now": T0, "n": 3}
    floored = {**fresh, "from_seq": 5, "from_time": LOWEST, "front": False}
    assert walks.found(FRESH, floored, [row(5)]) is True  # (short from a floor: read again)
    assert walks.found(FRESH, floored, [row(5), row(6), row(7)]) is False
    assert walks.found(FRESH, walks.again(FRESH, floored), [row(1)]) is False  # (the front)
    walks = Walks(Ticking())
    assert walk(walks, FRESH, fresh, [row(5), row(6), row(9)]) == (LOWEST, LOWEST)
    assert walk(walks, FRESH, fresh, [row(10), row(11), row(12)]) == (5, LOWEST)
    assert walk(walks, FRESH, fresh, [row(13)]) == (10, LOWEST)  # short:
    assert walk(walks, FRESH, fresh, [row(2), row(14), row(15)]) == (LOWEST, LOWEST)
    assert walk(walks, FRESH, fresh, []) == (2, LOWEST)
    assert walk(walks, FRESH, fresh, []) == (LOWEST, LOWEST)


def test_reclaims_do_not_move_the_pending_floor_and_each_statement_keeps_its_own():
    walks = Walks(Ticking())
    claim = {"now": T0, "n": 2, "losses": 3}
    walk(walks, NEXT, claim, [row(1, reclaim=True), row(7)])
    assert walks.seq[NEXT] == 7
    walk(walks, NEXT, claim, [row(8, reclaim=True), row(9, reclaim=True)])
    assert walks.seq[NEXT] == LOWEST  # (no pending job taken: from the front)
    walk(walks, FRESH, {"now": T0, "n": 1}, [row(30)])
    assert walks.seq[FRESH] == 30 and walks.seq[NEXT] == LOWEST


def test_every_walk_is_from_the_front_once_a_second_or_ten_times_its_own_time():
    clock = Ticking()
    walks = Walks(clock)
    fresh = {"now": T0, "n": 1}
    walk(walks, FRESH, fresh, [row(1)])
    clock.now += FULL_S * 0.9
    assert walk(walks, FRESH, fresh, [row(2)]) == (1, LOWEST)
    clock.now += FULL_S * 0.1
    walks.begin()
    floored = walks.floored(FRESH, fresh)  # a walk from the front that takes 0.5 s
    assert floored is not None and floored[1]["from_seq"] == LOWEST
    clock.now += 0.5
    walks.found(FRESH, floored[1], [row(3)])
    assert walks.every[FRESH] == pytest.approx(5.0)  # the next one 5 s after it began
    clock.now += 4.4
    assert walk(walks, FRESH, fresh, [row(4)]) == (3, LOWEST)
    clock.now += 0.1
    assert walk(walks, FRESH, fresh, [row(5)]) == (LOWEST, LOWEST)
    assert walks.every[FRESH] == FULL_S  # (that one took no time)


def test_the_statements_walks_from_the_front_share_one_tenth_of_the_sessions_time():
    """Two statements whose walks from the front take a quarter of a second each: each walks
    from the front every 5 s, so that they take 0.5 s of every 5 in all, not of every 2.5."""
    clock = Ticking()
    walks = Walks(clock)

    def front_walk(sql: str, params: dict[str, Any], rows: list[Any], took: float) -> None:
        walks.begin()
        floored = walks.floored(sql, params)
        assert floored is not None and floored[1]["front"]
        clock.now += took
        walks.found(sql, floored[1], rows)

    claim, check = {"now": T0, "n": 1, "losses": 3}, {"now": T0}
    front_walk(NEXT, claim, [row(1)], 0.25)
    assert walks.every[NEXT] == pytest.approx(2.5)  # (alone so far: ten times its own)
    front_walk(DUE, check, [(False,)], 0.25)
    assert walks.every[DUE] == pytest.approx(5.0)
    clock.now += 1.0  # (1.5 s since the claim's walk from the front began: from its floor)
    assert walk(walks, NEXT, claim, [row(2)]) == (1, LOWEST)
    clock.now += 1.0  # (2.5 s: from the front, on the period its walk alone set)
    front_walk(NEXT, claim, [row(3)], 0.25)
    assert walks.every[NEXT] == pytest.approx(5.0)
    assert 0.25 / walks.every[NEXT] + 0.25 / walks.every[DUE] == pytest.approx(0.1)
    clock.now += 2.5  # (5 s since the check's walk from the front began)
    front_walk(DUE, check, [(False,)], 1.5)  # (1.75 s in all: at most every 10 s, however long)
    assert walks.every[DUE] == MOST_S
    clock.now += 1.0  # (a walk from the front that rolls back: the shares are as they were)
    front_walk(NEXT, claim, [row(4)], 0.5)
    assert walks.took == {NEXT: 0.5, DUE: 1.5}
    walks.rollback()
    assert walks.took == {NEXT: 0.25, DUE: 1.5} and walks.every[NEXT] == pytest.approx(5.0)
    clock.now += 2 * MOST_S  # (the check no longer walks: its slow walk counts no more)
    front_walk(NEXT, claim, [row(5)], 0.25)
    assert walks.every[NEXT] == pytest.approx(2.5)


def test_a_claim_read_again_from_the_front_counts_both_reads_and_no_time_is_negative():
    """A claim read again after the quarantine in its transaction walks from the front again
    when its first read did: both reads count in its share.  A clock stepped back (an
    injected one) counts no negative time."""
    clock = Ticking()
    walks = Walks(clock)
    claim = {"now": T0, "n": 2, "losses": 3}
    walks.begin()
    first = walks.floored(NEXT, claim)
    assert first is not None and first[1]["front"]
    clock.now += 0.25
    walks.found(NEXT, first[1], [row(1), row(2)])
    clock.now += 0.05  # (the quarantine)
    again = walks.floored(NEXT, {**claim, "now": T0 + 1})
    assert again is not None and again[1]["front"]
    clock.now += 0.25
    walks.found(NEXT, again[1], [row(3), row(4)])
    assert walks.took[NEXT] == pytest.approx(0.5) and walks.every[NEXT] == pytest.approx(5.0)
    walks.begin()
    clock.now += 5.0
    floored = walks.floored(DUE, {"now": T0 + 2})
    assert floored is not None and floored[1]["front"]
    clock.now -= 3.0
    walks.found(DUE, floored[1], [(False,)])
    assert walks.took[DUE] == 0.0 and walks.every[DUE] == pytest.approx(5.0)


def test_leases_are_read_by_the_walks_from_the_front_only():
    clock = Ticking()
    walks = Walks(clock)
    claim = {"now": T0, "n": 2, "losses": 3}
    fronts = []
    for now, rows in ((T0, [row(1), row(2)]), (T0 + 50, [row(3), row(4)]), (T0 + 60, [row(5)])):
        walks.begin()
        floored = walks.floored(NEXT, {**claim, "now": now})
        assert floored is not None
        fronts.append(floored[1]["front"])
        again = walks.found(NEXT, floored[1], rows)
    assert fronts == [True, False, False] and again  # (short from a floor: read again,
    front = walks.again(NEXT, floored[1])  # leases and all)
    assert front["front"] and walks.found(NEXT, front, [row(5)]) is False
    walks.begin()
    floored = walks.floored(NEXT, {**claim, "now": T0 + 70})  # (short from the front:
    assert floored is not None and floored[1]["front"]  # the next claim is too, once)
    walks.found(NEXT, floored[1], [row(6), row(7)])
    walks.begin()
    assert walks.floored(NEXT, claim) == (
        FLOORED[NEXT],
        {**claim, "from_seq": 6, "from_time": LOWEST, "front": False},
    )
    clock.now += FULL_S
    walks.begin()
    assert walks.floored(NEXT, claim)[1]["front"]  # type: ignore[index]
    assert NEXT not in walks.time  # (no floor on a lease's end)


def test_a_statement_read_again_in_a_transaction_walks_from_its_first_reads_floors():
    """A claim read again after the quarantine, in the same transaction, takes what its
    first read took: from the front when that one was (with the lapsed leases it locked),
    whatever floor the first read's jobs would have set."""
    clock = Ticking()
    walks = Walks(clock)
    claim = {"now": T0, "n": 2, "losses": 3}
    assert walk(walks, NEXT, claim, [row(1), row(2)]) == (LOWEST, LOWEST)  # (floor: 1)
    clock.now += FULL_S
    walks.begin()
    first = walks.floored(NEXT, claim)
    assert first is not None and first[1]["front"]
    walks.found(NEXT, first[1], [row(3, reclaim=True), row(4)])  # (floor: 4)
    again = walks.floored(NEXT, {**claim, "now": T0 + 1})  # (after the quarantine)
    assert again is not None and again[1] == {**first[1], "now": T0 + 1}
    walks.begin()  # (the next transaction: from the floor)
    assert walks.floored(NEXT, claim)[1]["from_seq"] == 4  # type: ignore[index]


def test_a_transaction_that_rolls_back_leaves_the_floors_as_it_found_them():
    """Its plan run again (a conflict, a lost session) walks as the first try did: from the
    front, with the lapsed leases that try found."""
    clock = Ticking()
    walks = Walks(clock)
    claim = {"now": T0, "n": 2, "losses": 3}
    walk(walks, NEXT, claim, [row(1), row(2)])
    clock.now += FULL_S
    walks.begin()
    first = walks.floored(NEXT, claim)
    assert first is not None and first[1]["front"]
    walks.found(NEXT, first[1], [row(3, reclaim=True), row(4)])
    walks.rollback()
    walks.begin()
    assert walks.floored(NEXT, claim) == first


def test_one_slow_walk_from_the_front_stretches_their_period_to_ten_seconds_at_most():
    clock = Ticking()
    walks = Walks(clock)
    walks.begin()
    floored = walks.floored(FRESH, {"now": T0, "n": 1})
    assert floored is not None
    clock.now += 30.0  # (a stalled event loop, a table lock)
    walks.found(FRESH, floored[1], [row(1)])
    assert walks.every[FRESH] == MOST_S == 10 * FULL_S


class Scout:
    """A scout whose walks end when the test says: each with its rows, or failing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.begun: list[tuple[str, dict[str, Any], Callable[[], None]]] = []
        self.answers: list[asyncio.Future[list[tuple[Any, ...]]]] = []

    async def __call__(
        self, sql: str, params: dict[str, Any], begun: Callable[[], None]
    ) -> list[tuple[Any, ...]]:
        self.calls.append((sql, params))
        self.begun.append((sql, params, begun))
        self.answers.append(asyncio.get_running_loop().create_future())
        return await self.answers[-1]


def slow_front_walk(walks: Walks, clock: Ticking, sql: str, params: dict[str, Any]) -> None:
    """A walk from the front that takes 0.5 s and finds jobs from seq 100 on."""
    walks.begin()
    floored = walks.floored(sql, params)
    assert floored is not None and floored[1]["from_seq"] == LOWEST
    clock.now += 0.5
    walks.found(sql, floored[1], [row(100 + i) for i in range(params["n"])])
    assert walks.seq[sql] == 100 and walks.every[sql] == pytest.approx(5.0)


async def launched(sql: str, params: dict[str, Any]) -> tuple[Ticking, Scout, Walks]:
    """Walks whose slow walk from the front (``slow_front_walk``) had the next one due go to
    a scout, still on its way, while that claim walked from its floor (seq 100)."""
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    slow_front_walk(walks, clock, sql, params)
    clock.now += 5.0
    rows = [row(100 + i) for i in range(params["n"])]
    assert walk(walks, sql, params, rows) == (100, LOWEST)
    await asyncio.sleep(0)
    assert len(scout.calls) == 1
    return clock, scout, walks


async def test_a_slow_walk_from_the_front_is_scouted_and_claims_keep_their_floors_meanwhile():
    """Once a claim's walk from the front has taken ``SCOUT_S``, the next one due is a
    scout's, on its own session, without locks: the claims walk from their floor while it
    is on its way; the next claim after it walks from the first pending job it found, and
    reads the lapsed leases if it found one; its time is the walks' time."""
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    claim = {"now": T0, "n": 4, "losses": 3}
    slow_front_walk(walks, clock, NEXT, claim)
    clock.now += 5.0  # (due)
    walks.begin()
    floored = walks.floored(NEXT, claim)
    assert floored is not None and floored[1]["from_seq"] == 100
    assert floored[1]["front"] is False
    await asyncio.sleep(0)  # (the scout starts)
    [(sql, params)] = scout.calls
    assert sql == SCOUTED and "FOR UPDATE" not in sql and "FOR UPDATE" in FLOORED[NEXT]
    assert params == {"now": T0, "n": 4, "from_seq": LOWEST, "front": True}
    assert walks.found(NEXT, floored[1], [row(100 + i) for i in range(4)]) is False
    clock.now += MOST_S  # (due again: the scout is still on its way, the claims walk on)
    assert walk(walks, NEXT, claim, [row(104 + i) for i in range(4)]) == (100, LOWEST)
    assert len(scout.calls) == 1
    clock.now += 0.7
    scout.answers[0].set_result([row(40), row(70, reclaim=True), row(108), row(109)])
    await asyncio.sleep(0)
    walks.begin()
    floored = walks.floored(NEXT, claim)
    assert floored is not None
    assert (floored[1]["from_seq"], floored[1]["front"]) == (40, True)
    assert walks.took[NEXT] == pytest.approx(MOST_S + 0.7)  # (the scout's time)
    assert walks.found(NEXT, floored[1], [row(40)]) is True  # (short, from a floor: again)
    assert walk(walks, NEXT, claim, [row(109 + i) for i in range(4)]) == (LOWEST, LOWEST)


async def test_a_scouts_time_runs_from_its_walks_start_not_from_its_launch():
    """A scout waits for its session first (another scout's still closing it, or a
    connect): its time, the statements' walk time, runs from ``begun``, the walk's start."""
    clock, scout, walks = await launched(NEXT, {"now": T0, "n": 4, "losses": 3})
    clock.now += 3.0  # (waiting for its session)
    [(_, _, begun)] = scout.begun
    begun()
    clock.now += 0.25
    scout.answers[0].set_result([row(40)])
    await asyncio.sleep(0)
    walks.begin()
    walks.floored(NEXT, {"now": T0, "n": 4, "losses": 3})
    assert walks.took[NEXT] == pytest.approx(0.25)


async def test_a_scout_that_finds_nothing_behind_the_floor_leaves_it_and_one_that_fails_does_not():
    fresh = {"now": T0, "n": 2}
    clock, scout, walks = await launched(FRESH, fresh)
    clock.now += 0.5  # (a slow scout: the next walk from the front is a scout's too)
    scout.answers[0].set_result([row(102), row(103)])  # (the claims' own region: no lower)
    await asyncio.sleep(0)
    assert walk(walks, FRESH, fresh, [row(102), row(103)]) == (100, LOWEST)
    clock.now += MOST_S
    assert walk(walks, FRESH, fresh, [row(104), row(105)]) == (102, LOWEST)
    await asyncio.sleep(0)
    assert len(scout.calls) == 2
    scout.answers[1].set_exception(psycopg.OperationalError("the scouts' session ended"))
    await asyncio.sleep(0)
    assert walk(walks, FRESH, fresh, [row(3), row(106)]) == (LOWEST, LOWEST)  # (the front)


async def test_a_transaction_that_rolls_back_leaves_a_scouts_finding_to_its_re_run():
    claim = {"now": T0, "n": 4, "losses": 3}
    _, scout, walks = await launched(NEXT, claim)
    scout.answers[0].set_result([row(40), row(70, reclaim=True)])
    await asyncio.sleep(0)
    for _ in range(2):  # the first try rolls back; its re-run walks as it did
        walks.begin()
        floored = walks.floored(NEXT, claim)
        assert floored is not None
        assert (floored[1]["from_seq"], floored[1]["front"]) == (40, True)
        walks.rollback()
    assert len(scout.calls) == 1


async def test_a_rollback_of_the_claim_that_sent_a_scout_leaves_it_its_whole_time():
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    fresh = {"now": T0, "n": 2}
    slow_front_walk(walks, clock, FRESH, fresh)
    clock.now += SCOUT_WAIT_S + 10  # (an idle queue: its last walk long ago)
    for _ in range(2):  # the claim that sends the scout rolls back; its re-run waits for it
        walks.begin()
        floored = walks.floored(FRESH, fresh)
        assert floored is not None and floored[1]["from_seq"] == 100
        walks.rollback()
    await asyncio.sleep(0)
    assert len(scout.calls) == 1 and not scout.answers[0].done()


async def test_one_scout_walks_for_both_statements_and_each_takes_its_finding():
    """The scout sent for one claim statement walks for the other too: the fresh claim's
    jobs are among the pending jobs it reads.  Each statement walks from its floor while it
    is on its way, then from the first pending job it found; both are next due from its
    start, and a scout too long on its way has each statement's next claim walk from the
    front."""
    claim, fresh = {"now": T0, "n": 4, "losses": 3}, {"now": T0, "n": 2}
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    slow_front_walk(walks, clock, NEXT, claim)
    walks.seq[FRESH], walks.took[FRESH] = 100, 1.0
    walks.fronts[FRESH] = walks.sent[FRESH] = clock.now  # (in use)
    clock.now += 5.0
    assert walk(walks, NEXT, claim, [row(100 + i) for i in range(4)]) == (100, LOWEST)
    await asyncio.sleep(0)
    assert len(scout.calls) == 1
    launch = clock.now
    assert walks.scouts[FRESH] is walks.scouts[NEXT] and walks.launched[FRESH] == launch
    assert walk(walks, FRESH, fresh, [row(104), row(105)]) == (100, LOWEST)  # (on its way)
    clock.now += 0.5
    retried = (20, "j20", 1, 1, 1, T0 + LEASE, False, 0)  # (a due retry: NEXT's, not FRESH's)
    scout.answers[0].set_result([retried, row(40), row(70, reclaim=True)])
    await asyncio.sleep(0)
    assert walk(walks, FRESH, fresh, [row(40), row(106)]) == (40, LOWEST)  # (its finding)
    assert walks.took[FRESH] == walks.took[NEXT] == pytest.approx(0.5)  # (its time: both)
    walks.begin()
    floored = walks.floored(NEXT, claim)
    assert floored is not None and (floored[1]["from_seq"], floored[1]["front"]) == (20, True)
    assert len(scout.calls) == 1 and walks.scouts == {}
    rows = [retried, row(40), row(70, reclaim=True), row(108)]
    assert walks.found(NEXT, floored[1], rows) is False
    # the next one goes for both again; stopped after SCOUT_WAIT_S, each walks from the front
    clock.now += MOST_S
    assert walk(walks, FRESH, fresh, [row(110), row(111)]) == (40, LOWEST)  # (a new one)
    await asyncio.sleep(0)
    assert len(scout.calls) == 2 and walks.scouts[NEXT] is walks.scouts[FRESH]
    clock.now += SCOUT_WAIT_S
    assert walk(walks, NEXT, claim, [row(3 + i) for i in range(4)]) == (LOWEST, LOWEST)
    await asyncio.sleep(0)
    assert scout.answers[1].cancelled()
    assert walk(walks, FRESH, fresh, [row(7), row(109)]) == (LOWEST, LOWEST)


async def test_a_statement_no_longer_in_use_is_not_given_the_other_ones_scout():
    """A scout sent by one claim statement walks for the other only while that one is in
    use (it walked from the front within twice ``MOST_S``): one not in use keeps its
    schedule, and counts no more in the other's share."""
    claim, fresh = {"now": T0, "n": 4, "losses": 3}, {"now": T0, "n": 2}
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    slow_front_walk(walks, clock, FRESH, fresh)
    clock.now += 2 * MOST_S + 1  # (the fresh claim: not used since)
    slow_front_walk(walks, clock, NEXT, claim)
    clock.now += 5.0
    assert walk(walks, NEXT, claim, [row(100 + i) for i in range(4)]) == (100, LOWEST)
    await asyncio.sleep(0)
    assert len(scout.calls) == 1 and list(walks.scouts) == [NEXT]
    assert walks.fronts[FRESH] == 1000.0  # (its schedule as it was)
    clock.now += 0.05
    scout.answers[0].set_result([row(100)])  # (a quick scout: NEXT walks every FULL_S)
    await asyncio.sleep(0)
    walk(walks, NEXT, claim, [row(100 + i) for i in range(4)])
    assert walks.every[NEXT] == FULL_S


def both_slow(took: float) -> tuple[Ticking, Scout, Walks]:
    """Walks whose two claim statements, both in use, walk from a floor (seq 100) and last
    walked from the front just now, in ``took`` seconds."""
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    for sql in (NEXT, FRESH):
        walks.seq[sql], walks.took[sql], walks.every[sql] = 100, took, MOST_S
        walks.fronts[sql] = walks.sent[sql] = clock.now
    return clock, scout, walks


async def test_a_statement_sent_in_every_transaction_is_given_each_scout_however_long():
    """Whether the other statement is in use is when it was last sent, not when it last
    walked from the front: after a scout of 21 s (more than twice ``MOST_S``), the next one
    goes for both statements still, and neither walks from the front on the queue's
    session meanwhile."""
    claim, fresh = {"now": T0, "n": 4, "losses": 3}, {"now": T0, "n": 2}
    clock, scout, walks = both_slow(21.0)

    def both() -> None:  # (one transaction sending both statements from their floors)
        walks.begin()
        for sql, params in ((NEXT, claim), (FRESH, fresh)):
            floored = walks.floored(sql, params)
            assert floored is not None and floored[1]["from_seq"] == 100, sql
            walks.found(sql, floored[1], [row(100 + i) for i in range(params["n"])])

    clock.now += MOST_S
    both()
    await asyncio.sleep(0)
    for i in range(1, 3):
        for _ in range(21):
            clock.now += 1.0
            both()
        scout.answers[-1].set_result([row(100)])  # (back after 21 s)
        await asyncio.sleep(0)
        clock.now += 0.1
        both()  # (each takes its finding; the next scout goes at the next claim)
        clock.now += 0.1
        both()
        await asyncio.sleep(0)
        assert len(scout.calls) == i + 1 and walks.scouts[NEXT] is walks.scouts[FRESH]


async def test_a_rollback_gives_back_the_findings_it_took_and_keeps_the_scout_it_sent():
    """A transaction that rolls back leaves its re-run each scout's finding it used, and
    keeps a scout it sent for each statement it was given to (not the older finding the
    other statement held, unused)."""
    claim, fresh = {"now": T0, "n": 4, "losses": 3}, {"now": T0, "n": 2}
    clock, scout, walks = both_slow(1.0)
    clock.now += MOST_S
    walk(walks, NEXT, claim, [row(100 + i) for i in range(4)])
    await asyncio.sleep(0)
    clock.now += 0.5  # (a slow scout: the next walk from the front is a scout's too)
    scout.answers[0].set_result([row(60)])
    await asyncio.sleep(0)
    first = walks.scouts[FRESH]  # (found 60; the fresh claim not sent since)
    walk(walks, NEXT, claim, [row(60), *(row(101 + i) for i in range(3))])  # (NEXT's: taken)
    clock.now += MOST_S
    walks.sent[FRESH] = clock.now - 1  # (sent a second ago: in use)
    walks.begin()  # NEXT sends the next scout, for both; the transaction rolls back
    assert walks.floored(NEXT, claim) is not None
    await asyncio.sleep(0)
    second = walks.scouts[NEXT]
    assert second is not first and walks.scouts[FRESH] is second
    walks.rollback()
    assert walks.scouts[NEXT] is walks.scouts[FRESH] is second
    scout.answers[1].set_result([row(50)])
    await asyncio.sleep(0)
    assert walk(walks, FRESH, fresh, [row(50), row(104)]) == (50, LOWEST)  # (its finding)
    # and one whose finding the transaction took: given back to its re-run
    walks.begin()
    floored = walks.floored(NEXT, claim)
    assert floored is not None and floored[1]["from_seq"] == 50
    walks.rollback()
    assert walk(walks, NEXT, claim, [row(50), *(row(104 + i) for i in range(3))]) == (50, LOWEST)
    assert len(scout.calls) == 2


async def test_a_rollback_keeps_the_schedule_of_the_scout_it_sent():
    """A scout sent by a transaction that rolls back goes on, and so does its schedule:
    the next one is due ``MOST_S`` after its start (not at once after it is back)."""
    claim = {"now": T0, "n": 4, "losses": 3}
    rows = [row(100 + i) for i in range(4)]
    clock, scout, walks = both_slow(1.0)
    clock.now += MOST_S
    launch = clock.now
    walks.begin()
    floored = walks.floored(NEXT, claim)
    assert floored is not None
    walks.found(NEXT, floored[1], rows)
    walks.rollback()
    assert walk(walks, NEXT, claim, rows) == (100, LOWEST)  # (its re-run: the scout goes on)
    await asyncio.sleep(0)
    clock.now += 2.0
    scout.answers[0].set_result([row(100)])
    await asyncio.sleep(0)
    while clock.now < launch + MOST_S - 0.15:
        clock.now += 0.1
        assert walk(walks, NEXT, claim, rows) == (100, LOWEST)
        await asyncio.sleep(0)
    assert len(scout.calls) == 1
    clock.now = launch + MOST_S
    walk(walks, NEXT, claim, rows)
    await asyncio.sleep(0)
    assert len(scout.calls) == 2


async def test_a_rollback_that_took_a_finding_and_sent_a_scout_walks_on_from_the_floors():
    """A transaction that took one scout's finding (the claim of any job) and sent the next
    (the fresh claim) rolls back: the re-run takes the finding again, and the claim of any
    job waits on its floor for the scout on its way, never walking from the front on the
    queue's session while it is."""
    claim, fresh = {"now": T0, "n": 4, "losses": 3}, {"now": T0, "n": 2}
    clock, scout, walks = both_slow(1.0)
    clock.now += MOST_S
    walk(walks, NEXT, claim, [row(100 + i) for i in range(4)])  # (the first scout, for both)
    await asyncio.sleep(0)
    clock.now += 21.0
    scout.answers[0].set_result([row(60)])
    await asyncio.sleep(0)
    assert walk(walks, FRESH, fresh, [row(60), row(101)]) == (60, LOWEST)  # (FRESH's: taken)
    clock.now += 0.1
    for again in (False, True):  # (the first try rolls back)
        walks.begin()
        taking = walks.floored(NEXT, claim)
        assert taking is not None and taking[1]["from_seq"] == 60
        walks.found(NEXT, taking[1], [row(60), *(row(101 + i) for i in range(3))])
        sending = walks.floored(FRESH, fresh)
        assert sending is not None
        walks.found(FRESH, sending[1], [row(101), row(102)])
        if not again:
            walks.rollback()
        await asyncio.sleep(0)
    assert len(scout.calls) == 2 and not scout.answers[1].done()
    for _ in range(25):
        clock.now += 1.0
        assert walk(walks, NEXT, claim, [row(101 + i) for i in range(4)])[0] != LOWEST
        await asyncio.sleep(0)
    assert len(scout.calls) == 2  # (the one on its way: none sent beside it)


async def test_a_scout_too_long_on_its_way_is_stopped_and_the_claim_walks_from_the_front():
    fresh = {"now": T0, "n": 2}
    clock, scout, walks = await launched(FRESH, fresh)
    clock.now += SCOUT_WAIT_S - 0.1
    assert walk(walks, FRESH, fresh, [row(102), row(103)]) == (100, LOWEST)
    clock.now += 0.1
    assert walk(walks, FRESH, fresh, [row(3), row(104)]) == (LOWEST, LOWEST)
    await asyncio.sleep(0)
    assert scout.answers[0].cancelled() and walks.scouts == {}


async def test_a_quick_walk_from_the_front_is_not_scouted_nor_the_check():
    clock, scout = Ticking(), Scout()
    walks = Walks(clock, scout)
    fresh = {"now": T0, "n": 1}
    walk(walks, FRESH, fresh, [row(1)])
    clock.now += FULL_S
    assert walks.took[FRESH] < SCOUT_S
    assert walk(walks, FRESH, fresh, [row(2)]) == (LOWEST, LOWEST)
    walks.took[DUE] = 1.0  # (a slow check is walked from the front all the same)
    clock.now += 100
    assert walk(walks, DUE, {"now": T0 + 10}, [(False,)])[1] == LOWEST
    await asyncio.sleep(0)
    assert scout.calls == []


def test_the_checks_floor_is_the_clock_of_the_last_check():
    clock = Ticking()
    walks = Walks(clock)
    assert walk(walks, DUE, {"now": T0 + 60}, [(False,)]) == (LOWEST, LOWEST)
    assert walk(walks, DUE, {"now": T0 + 70}, [(False,)]) == (LOWEST, T0 + 60)
    assert walk(walks, DUE, {"now": T0 + 80}, [(True,)]) == (LOWEST, T0 + 70)
    assert walks.time[DUE] == T0 + 80  # (found: the quarantine, from the front, ends it)
    # the run's clock behind a floor (stepped back): from the front
    assert walk(walks, DUE, {"now": T0 + 10}, [(False,)]) == (LOWEST, LOWEST)
    assert walks.time[DUE] == T0 + 10
    clock.now += FULL_S
    assert walk(walks, DUE, {"now": T0 + 20}, [(False,)]) == (LOWEST, LOWEST)


def test_other_statements_and_positional_parameters_take_no_floor():
    walks = Walks()
    assert walks.floored(w.SQL_NEXT_FRESH, {"now": T0, "n": 1}) is None
    assert walks.floored(w.SQL_LEASE, ("o", T0, "[]")) is None
    assert walks.floored(FRESH, (T0, 1)) is None
    assert set(FLOORED) == {FRESH, NEXT, DUE}


# --- on a server -------------------------------------------------------------------


@pytest.fixture
def url(pg_db):
    return pg_db()


async def fill(q: AsyncQueue, ids: list[str], now: int = T0) -> None:
    await q.enqueue_many([{"id": i, "qty": 1} for i in ids], now)


async def cycle(q: AsyncQueue, now: int, count: int, fresh: int = 0, results=()) -> list[str]:
    _, _, tickets, _ = await q.cycle(list(results), [], "me", now, LEASE, count, fresh)
    return [t["id"] for t in tickets]


async def test_a_retry_behind_the_floor_is_claimed_by_the_next_walk_from_the_front(url):
    async with AsyncQueue.open(url) as q:
        walks = q._db.walks
        clock = walks.clock = Ticking()
        await fill(q, ["r", *(f"b{i}" for i in range(10))])
        [first, *_] = (await q.cycle([], [], "me", T0, LEASE, 2, 0))[2]
        assert first["id"] == "r"
        # r fails: a retry due 50 ms later, behind the floor the next claims walk from
        assert await cycle(q, T0 + 1, 0, results=[(first, "retry", T0 + 1, 50)]) == []
        assert await cycle(q, T0 + 2, 2) == ["b1", "b2"]
        assert await cycle(q, T0 + 100, 2) == ["b3", "b4"]  # due, but behind the floor
        clock.now += FULL_S
        assert await cycle(q, T0 + 101, 2) == ["r", "b5"]  # the walk from the front
        # a claim that comes up short: the next one walks from the front
        assert await cycle(q, T0 + 102, 10) == ["b6", "b7", "b8", "b9"]
        assert walks.seq[NEXT] == LOWEST


async def test_a_retry_behind_the_floor_is_found_by_a_scout_on_a_session_of_its_own(url):
    """With slow walks from the front (a held snapshot's dead entries), the walk is a
    scout's, on a session of its own: the queue's claims go on from their floor, the retry
    the scout found is taken by the claim after it, and the scouts' session ends with the
    queue."""
    async with AsyncQueue.open(url) as q:
        walks = q._db.walks
        clock = walks.clock = Ticking()
        await fill(q, ["r", *(f"b{i}" for i in range(10))])
        [first, *_] = (await q.cycle([], [], "me", T0, LEASE, 2, 0))[2]
        assert await cycle(q, T0 + 1, 0, results=[(first, "retry", T0 + 1, 50)]) == []
        assert await cycle(q, T0 + 2, 2) == ["b1", "b2"]
        walks.took[NEXT] = 1.0  # (its last walk from the front was slow)
        clock.now += MOST_S
        assert await cycle(q, T0 + 100, 2) == ["b3", "b4"]  # from the floor: a scout goes
        await asyncio.wait_for(asyncio.shield(walks.scouts[NEXT]), 60)
        scouts = q._db.scout_con
        assert scouts is not None and not scouts.closed
        pid = scouts.info.backend_pid
        seen = "SELECT application_name FROM pg_stat_activity WHERE pid = %s"
        assert query(url, seen, (pid,)) == [(SCOUT_NAME,)]
        assert await cycle(q, T0 + 101, 2) == ["r", "b5"]  # from the retry the scout found
        assert await cycle(q, T0 + 102, 2) == ["b6", "b7"]
    assert await ended(url)  # (the scouts' session too)


async def test_the_scouts_session_closes_once_idle_and_the_next_scout_opens_another(
    url, monkeypatch
):
    """The scouts' session no scout has used for ``SCOUT_IDLE_S`` is closed (its backend
    ends): walks quick again leave no idle session behind.  A scout on its way when the
    time comes keeps it; the next scout opens another."""
    monkeypatch.setattr(pg_session, "SCOUT_IDLE_S", 0.2)
    async with AsyncQueue.open(url) as q:
        store = q._db
        assert await store._scout("SELECT 1", {}) == [(1,)]
        first = store.scout_con
        assert first is not None
        pid = first.info.backend_pid
        async with store.scouting:  # (as a scout on its way holds it)
            store._close_idle()
            assert store.scout_con is first and not first.closed
        await until(lambda: first.closed)  # the scout's timer, 0.2 s after it
        assert store.scout_con is None
        seen = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
        await until(lambda: query(url, seen, (pid,)) == [])  # (its backend ended)
        assert await store._scout("SELECT 2", {}) == [(2,)]
        second = store.scout_con
        assert second is not None and second is not first and not second.closed
        names = "SELECT application_name FROM pg_stat_activity WHERE pid = %s"
        assert query(url, names, (second.info.backend_pid,)) == [(SCOUT_NAME,)]
    timer = store.scouts_idle  # (the second scout's, cancelled by the store's close)
    assert timer is not None and timer.cancelled() and second.closed
    assert await ended(url)


async def test_a_scouts_time_is_its_walk_not_the_connect_of_its_session(url, monkeypatch):
    """The first scout after the scouts' session closed opens another; that connect (a TLS
    handshake to a distant server can take longer than ``SCOUT_S``) is not the walk's time,
    which decides whether the claims go on being scouted.  A connect held 2 s here."""
    connect = pg_session.aconnect

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(2.0)
        return await connect(*args, **kwargs)

    async with AsyncQueue.open(url) as q:
        store = q._db
        monkeypatch.setattr(pg_session, "aconnect", slow)
        began = time.monotonic()
        rows, took = await store.walks._scouting({"now": T0, "n": 4})
        assert time.monotonic() - began >= 2.0  # (the connect was waited for)
        assert rows == [] and took < 2.0 and store.scout_con is not None
        rows, took = await store.walks._scouting({"now": T0, "n": 4})  # (its session kept)
        assert rows == [] and took < 2.0
    assert await ended(url)


async def test_a_scout_that_ends_as_the_store_closes_sets_no_idle_timer(url):
    """A scout on its way when the store closes its scouts' session ends (its walk fails at
    once) without setting the idle close's timer again: nothing of the store is left to
    run on the loop after it."""
    async with AsyncQueue.open(url) as q:
        store = q._db
        walking = asyncio.ensure_future(store._scout("SELECT pg_sleep(10)", {}))
        await until(lambda: store.scouting.locked() and store.scout_con is not None)
        await asyncio.wait_for(store._close_scouts(), 60)
        with pytest.raises(psycopg.Error):
            await asyncio.wait_for(walking, 60)
        assert store.scouts_idle is None or store.scouts_idle.cancelled()
    assert await ended(url)


async def scouted(q: AsyncQueue) -> None:
    """Until every scout of the queue's store on its way is back."""
    for scout in list(q._db.walks.scouts.values()):
        await asyncio.wait_for(asyncio.shield(scout), 60)


async def test_a_claims_two_statements_are_scouted_by_one_walk_on_one_session(url):
    """A claim of attempted and fresh jobs at once sends both statements: one scout walks
    for both, on the one session of the scouts, which ends with the queue.  A fresh job
    behind the fresh claim's floor (its intake committed after the claims passed its seq)
    is found by that walk, whichever statement sent it; the fresh claim walks from it, not
    from a due retry further behind (which the claim of any job takes)."""
    async with AsyncQueue.open(url) as q:
        walks = q._db.walks
        clock = walks.clock = Ticking()
        sent: list[str] = []
        scout = walks.scout
        assert scout is not None

        async def counted(
            sql: str, params: dict[str, Any], begun: Callable[[], None]
        ) -> list[tuple[Any, ...]]:
            sent.append(sql)
            return await scout(sql, params, begun)

        walks.scout = counted
        await fill(q, [f"b{i:02}" for i in range(10)])
        with psycopg.connect(url) as late:  # (an intake that commits late)
            late.execute(
                "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
                " available_at, deadline) VALUES ('late', 1, 'pending', 0, 3, 0, %s, %s)",
                (T0, T0 + 3_600_000),
            )
            await fill(q, [f"b{i:02}" for i in range(10, 30)])
            [first, *_] = (await q.cycle([], [], "me", T0, LEASE, 2, 2))[2]
            retry = [(first, "retry", T0 + 1, 50)]  # (b00: due again at T0 + 51)
            assert await cycle(q, T0 + 1, 2, 6, retry) == [f"b{i:02}" for i in range(4, 12)]
            assert await cycle(q, T0 + 2, 2, 2) == ["b12", "b13", "b14", "b15"]
        [(late_seq,)] = query(url, "SELECT seq FROM jobs WHERE id = 'late'")
        walks.took[NEXT] = walks.took[FRESH] = 1.0
        clock.now += MOST_S
        assert await cycle(q, T0 + 100, 2, 2) == ["b16", "b17", "b18", "b19"]  # (floors: b12)
        assert set(walks.scouts) == {NEXT, FRESH} and walks.scouts[NEXT] is walks.scouts[FRESH]
        await scouted(q)
        assert walks.scouts[FRESH].exception() is None
        assert await cycle(q, T0 + 101, 0, 2) == ["late", "b20"]
        assert walks.within[FRESH]["from_seq"] == late_seq  # (not the retry's, b00's)
        assert await cycle(q, T0 + 102, 1) == ["b00"]  # (the claim of any job: its finding)
        assert sent == [SCOUTED] and walks.scouts == {}
        assert pgdb.sessions(url) - pgdb.sessions(url, scouts=False) == 1
        # sent by the fresh claim alone (no claim of attempted jobs), it walks as well
        walks.took[FRESH] = 1.0
        clock.now += MOST_S
        assert await cycle(q, T0 + 103, 0, 2) == ["b21", "b22"]
        assert walks.scouts[NEXT] is walks.scouts[FRESH]
        await scouted(q)
        assert walks.scouts[FRESH].exception() is None and sent == [SCOUTED, SCOUTED]
        assert await cycle(q, T0 + 104, 0, 2) == ["b23", "b24"]
    assert await ended(url)


@pytest.mark.process
async def test_a_queue_closes_at_once_while_its_scout_waits_on_a_stopped_server_process(url):
    """The scouts' session is closed before the scouts are stopped: a scout waiting for a
    backend that does not answer (stopped) keeps the queue's close waiting for nothing."""
    async with AsyncQueue.open(url) as q:
        walks = q._db.walks
        clock = walks.clock = Ticking()
        await fill(q, [f"b{i:02}" for i in range(20)])
        assert await cycle(q, T0, 2) == ["b00", "b01"]
        walks.took[NEXT] = 1.0
        clock.now += MOST_S
        assert await cycle(q, T0 + 1, 2) == ["b02", "b03"]
        await scouted(q)  # (the scouts' session is open)
        assert await cycle(q, T0 + 2, 2) == ["b04", "b05"]  # (nothing behind the floor)
        scouts = q._db.scout_con
        assert scouts is not None
        pid = scouts.info.backend_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            walks.took[NEXT] = 1.0
            clock.now += MOST_S
            assert await cycle(q, T0 + 3, 2) == ["b06", "b07"]  # (its scout waits)
            assert not walks.scouts[NEXT].done()
            started = time.monotonic()
            await q.close()
            assert time.monotonic() - started < SCOUT_CLOSE_S / 2
        finally:
            os.kill(pid, signal.SIGCONT)
    assert await ended(url)


async def test_a_lapsed_lease_is_reclaimed_while_the_quarantine_has_work_each_claim(url):
    """With a job past its deadline at every claim, each claim is read again after the
    quarantine, in its transaction; the walk from the front that found a lapsed lease (and
    locked it) takes it in that second read too, behind a backlog that would fill a claim
    from the floor."""
    async with AsyncQueue.open(url) as q, AsyncQueue.open(url) as other:
        clock = q._db.walks.clock = Ticking()
        await fill(q, ["x", *(f"b{i:03}" for i in range(200))])
        _, _, [lost], _ = await other.cycle([], [], "gone", T0, 50, 1, 0)
        assert lost["id"] == "x"  # its lease lapses at T0 + 50, never finished
        now, found = T0 + 100, []
        for k in range(3):
            await q.enqueue_many([({"id": f"d{k}", "qty": 1}, 1, 3)], now)  # (due at once)
            clock.now += FULL_S
            now += 10
            found.append(await cycle(q, now, 2))
        assert found[0] == ["x", "b000"], found
        [(status, owner)] = query(url, "SELECT status, owner FROM jobs WHERE id = 'x'")
        assert (status, owner) == ("leased", "me")


async def test_a_claim_from_a_floor_that_comes_up_short_is_read_again_from_the_front(url):
    """A claim never takes fewer jobs than a walk from the front would: a retry due behind
    the floor is taken by the claim whose walk from the floor finds too few."""
    async with AsyncQueue.open(url) as q:
        q._db.walks.clock = Ticking()
        await fill(q, ["r", "b0", "b1", "b2"])
        [first, *_] = (await q.cycle([], [], "me", T0, LEASE, 2, 0))[2]
        assert await cycle(q, T0 + 1, 0, results=[(first, "retry", T0 + 1, 50)]) == []
        assert await cycle(q, T0 + 2, 1) == ["b1"]  # (the floor: b1's seq)
        assert await cycle(q, T0 + 100, 5) == ["r", "b2"]  # b2 alone from the floor: short


async def test_a_lapsed_lease_behind_the_floor_is_reclaimed_by_the_next_walk_from_the_front(url):
    async with AsyncQueue.open(url) as q, AsyncQueue.open(url) as other:
        walks = q._db.walks
        clock = walks.clock = Ticking()
        await fill(q, [f"a{i}" for i in range(6)], T0 + 55)  # (due at T0 + 55)
        await fill(q, ["x"])
        _, _, [lost], _ = await other.cycle([], [], "gone", T0, 50, 1, 0)
        assert lost["id"] == "x"  # its lease lapses at T0 + 50, never finished
        # a0-a5 (lower seqs) come first: the LIMIT leaves x out of the walk from the front
        assert await cycle(q, T0 + 60, 1) == ["a0"]
        assert await cycle(q, T0 + 70, 1) == ["a1"]  # (from the floor: no lease read)
        clock.now += FULL_S
        assert await cycle(q, T0 + 80, 6) == ["a2", "a3", "a4", "a5", "x"]


async def test_under_a_held_snapshot_a_claim_from_its_floor_steps_over_no_dead_entries(url):
    """The point of the floors: with a snapshot held open, the index entries of every job
    claimed since stay at the front of ``jobs_by_status``; a walk from the front reads them
    all again, a walk from the floor does not, and both find the same jobs.  Over a run, the
    claims read each entry a few times, not once per claim after it (47,100 entries for this
    run without floors)."""
    now = w.epoch_ms()  # (the Dispatcher's clock: the wall's)
    held = psycopg.connect(url)
    try:
        async with AsyncQueue.open(url) as q:
            q._db.walks.clock = Ticking()  # (no walk from the front for the time's sake)
            await fill(q, [f"j{i:05}" for i in range(3000)], now)
            held.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            held.execute("SELECT count(*) FROM jobs").fetchall()
            with psycopg.connect(url, autocommit=True) as con:
                before = entries_read(con)

            async def null(event: dict[str, Any], token: int) -> bool:
                return True

            summary = await Dispatcher(q, null, owner="d", concurrency=16, lease_ms=LEASE).run(
                max_jobs=2500
            )
            assert summary.done == 2500
        with psycopg.connect(url, autocommit=True) as con:  # (its session's counts, flushed)
            assert entries_read(con) - before < 6 * 2500
        [(floor,)] = query(url, "SELECT min(seq) FROM jobs WHERE status = 'pending'")
        params = {"now": w.epoch_ms(), "n": 64, "losses": 3, "from_time": LOWEST}
        front = claimed(url, FRESH, {**params, "from_seq": LOWEST, "front": True})
        floored = claimed(url, FRESH, {**params, "from_seq": floor, "front": False})
        # with statistics that count no lease (a planner may walk leases by status then),
        # the claim of waiting coroutines from its floor reads no more
        query(url, "ANALYZE jobs")
        waiting = claimed(url, NEXT, {**params, "from_seq": floor, "front": False})
        # the scout, for both statements: the fresh claim's first job is the walk's
        walked = {"now": params["now"], "n": 64, "from_seq": LOWEST, "front": True}
        scout = query(url, SCOUTED, walked)
        # the check from its floor, once every lease the run took has lapsed: by deadline
        check = {"now": now + LEASE + 5000, "from_time": now, "from_seq": LOWEST, "front": False}
        due = checked(url, check)
    finally:
        held.close()
    assert due[0] is False and due[1] <= 100, due
    assert front[0] == floored[0] == waiting[0] and len(floored[0]) == 64
    assert front[1] >= 2500 > 100 >= floored[1] >= 64, (front[1], floored[1])
    assert 100 >= waiting[1] >= 64, waiting[1]
    fresh = [r[1] for r in scout if not r[6] and r[3] == 0]
    assert fresh[0] == fresh[1] == front[0][0] and len(fresh) == 65  # (its first: both parts)


@pytest.mark.parametrize("analyzed", [False, True])
def test_each_floor_is_where_an_index_scan_starts_with_or_without_statistics(url, analyzed):
    """Every floor is an index condition (the scan starts there), never a filter over a
    walk from the front, whatever the table's statistics say; a claim's walk from a floor
    reads no lapsed lease, one from the front reads them."""
    asyncio.run(filled(url, 20_000))
    with psycopg.connect(url, autocommit=True) as con:
        con.execute(
            "UPDATE jobs SET status = 'leased', lease_until = available_at + 10 WHERE seq <= 500"
        )
        if analyzed:
            con.execute("ANALYZE jobs")
        con.execute(pg.SQL_CLAIMING)
        [(now,)] = con.execute("SELECT max(available_at) + 1000 FROM jobs").fetchall()
        floors = {"now": now, "n": 64, "losses": 3, "from_seq": 10_000, "from_time": now - 500}
        conds = {
            sql: index_conds(executed_plan(con, FLOORED[sql], {**floors, "front": False}))
            for sql in FLOORED
        }
        front_conds = index_conds(executed_plan(con, FLOORED[NEXT], {**floors, "front": True}))
        con.execute("UPDATE jobs SET attempts = 1 WHERE seq BETWEEN 501 AND 510")  # (retries)
        walked = {**floors, "n": 4, "from_seq": LOWEST, "front": True}
        scout_conds = index_conds(executed_plan(con, SCOUTED, walked))
        scout = [(r[0], r[3], r[6]) for r in con.execute(SCOUTED, walked).fetchall()]
        floored = claim_rows(con, {**floors, "front": False})
        front = claim_rows(con, {**floors, "from_seq": LOWEST, "front": True})
    assert any("seq >= " in c for c in conds[FRESH]), conds[FRESH]
    assert any("seq >= " in c for c in conds[NEXT]), conds[NEXT]
    # the check: pending and leased jobs by deadline from its floor, never by lease
    by_deadline = [c for c in conds[DUE] if c.startswith("jobs_by_deadline: ")]
    assert len(by_deadline) == 2 and all("deadline >= " in c for c in by_deadline), conds[DUE]
    assert not any("lease" in c for c in conds[DUE]), conds[DUE]
    # the claim's read of lapsed leases: never from a floor, from the front
    assert not any("lease" in c for c in conds[NEXT]), conds[NEXT]
    assert any("lease" in c for c in front_conds), front_conds
    assert floored == [(seq, False) for seq in range(10_000, 10_064)]
    assert front == [(seq, True) for seq in range(1, 65)]  # (the lapsed leases, first)
    # the scout's read of the fresh claim's first job starts at the first pending job
    assert any("jobs_by_status" in c and "seq >= $" in c for c in scout_conds), scout_conds
    assert scout == [
        *((seq, 0, True) for seq in range(1, 5)),  # (lapsed leases)
        *((seq, 1, False) for seq in range(501, 505)),  # (due retries)
        (511, 0, False),  # (the first job never attempted)
    ]


def claim_rows(con: psycopg.Connection[Any], params: dict[str, Any]) -> list[tuple[int, bool]]:
    """The jobs (seq, whether a reclaim) a claim of waiting coroutines takes (rolled back)."""
    con.execute("BEGIN")
    try:
        return [(r[0], r[6]) for r in con.execute(FLOORED[NEXT], params).fetchall()]
    finally:
        con.execute("ROLLBACK")


def test_with_statistics_that_count_no_pending_job_the_check_reads_by_deadline(url):
    """Statistics taken over done jobs count no pending or leased job: the check's EXISTS
    parts were then planned as walks of every pending or leased entry of ``jobs_by_status``
    (85-330 ms a check under a held snapshot).  From a floor and from the front, the check
    reads each part by deadline, from its floor."""
    with pg.connect(url) as con:  # (a queue's session, as claims run on)
        done_statistics(con, T0 + 3_600_000, T0)
        for from_time in (T0 - 200, LOWEST):
            plan = executed_plan(con, FLOORED[DUE], {"now": T0, "from_time": from_time})
            conds = index_conds(plan)
            assert len(conds) == 3, conds
            parts = [c for c in conds if c.startswith("jobs_by_deadline: ")]
            assert len(parts) == 2, conds  # (the pending part's, the leased part's)
            assert all(f"deadline >= '{from_time}'" in part for part in parts), parts
            assert any(c.startswith("jobs_spent: ") for c in conds), conds


@pytest.mark.parametrize("floored", [True, False])
def test_with_statistics_taken_before_any_lease_the_check_reads_leases_by_deadline(url, floored):
    """Statistics taken over done and pending jobs whose deadlines spread, before any job
    was leased, count no lease: the check's leased part was then planned as a read of the
    whole ``jobs_by_lease`` (one entry, it estimated) and a sort, which under a held
    snapshot reads every lease taken since (40-60 ms a check).  It reads them by deadline."""
    with pg.connect(url) as con:  # (a queue's session, as claims run on)
        leases_after_statistics(con)
        sql = FLOORED[DUE] if floored else STATEMENTS[DUE]
        params = {"now": T0 + 2000, "from_time": T0 + 1000} if floored else {"now": T0 + 2000}
        plan = executed_plan(con, sql, params)
        conds = index_conds(plan)
        assert not any(c.startswith("jobs_by_lease: ") for c in conds), conds
        assert len([c for c in conds if c.startswith("jobs_by_deadline: ")]) == 2, conds
        assert "Sort" not in str(plan), plan


@pytest.mark.parametrize("pending_then", [False, True])
@pytest.mark.parametrize("sql", [FRESH, NEXT])
def test_with_statistics_that_count_no_pending_job_a_claim_walks_from_its_floor(
    url, sql, pending_then
):
    """Statistics taken over done jobs count no pending job: a claim was then planned as a
    walk of every pending entry of ``jobs_by_deadline`` (a smaller index, and a sort of the
    one row it expected), its floor a filter; under a held snapshot every dead version of
    every job claimed since (700 ms a claim after seven minutes of load: 690 jobs/s).  It
    walks ``jobs_by_status`` from its floor, in its order, from the front too."""
    with pg.connect(url) as con:  # (a queue's session, as claims run on)
        done_statistics(con, T0 + 3_600_000, T0 + 3_600_000, pending_then)
        con.execute("UPDATE jobs SET attempts = 0 WHERE status = 'pending'")  # (never tried)
        params = {"now": T0, "n": 64, "losses": 3, "from_time": LOWEST}
        for from_seq, first in ((97_000, 97_000), (LOWEST, 90_001 if pending_then else 96_001)):
            front = from_seq == LOWEST
            plan = executed_plan(
                con, FLOORED[sql], {**params, "from_seq": from_seq, "front": front}
            )
            conds = index_conds(plan)
            assert not any(c.startswith("jobs_by_deadline: ") for c in conds), conds
            assert any(
                c.startswith("jobs_by_status: ") and "seq >= " in c and str(from_seq) in c
                for c in conds
            ), conds
            walked = [n["Actual Rows"] for n in scans(plan) if "seq >= " in n.get("Index Cond", "")]
            assert walked == [64], walked  # (in its order: no more than the claim takes)
            con.execute("BEGIN")
            try:
                rows = con.execute(FLOORED[sql], {**params, "from_seq": from_seq, "front": front})
                assert [r[0] for r in rows.fetchall()] == list(range(first, first + 64))
            finally:
                con.execute("ROLLBACK")


@pytest.mark.parametrize("analyzed", [False, True])
def test_a_claims_read_of_lapsed_leases_reads_those_leases_not_every_lease(url, analyzed):
    """20,000 leases in flight, 10 of them lapsed, 1,000 jobs pending: a claim's read of
    lapsed leases (a walk from the front: the core's claim and the floored one) reads about
    as many entries as there are lapsed leases and pending jobs it takes, never every lease
    in flight, and takes the same jobs as the read without the array of lapsed seqs."""
    with pg.connect(url) as con:  # (a queue's session, as claims run on)
        con.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")
        con.execute(
            "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
            " deadline, owner, lease_until) SELECT 'j' || i, 1, CASE WHEN i <= 20000 THEN"
            " 'leased' ELSE 'pending' END, 1, 3, 1, 0, %s, 'w', CASE WHEN i <= 20000 THEN"
            " %s + CASE WHEN i %% 2000 = 7 THEN -1000 ELSE 60000 END END"
            " FROM generate_series(1, 21000) AS i",
            (T0 + 3_600_000, T0),
        )
        if analyzed:
            con.execute("ANALYZE jobs")
        params = {"now": T0, "n": 64, "losses": 3, "from_seq": LOWEST, "from_time": LOWEST}
        for sql, run in ((STATEMENTS[NEXT], params), (FLOORED[NEXT], {**params, "front": True})):
            plan = executed_plan(con, sql, run)
            read = sum(n["Actual Rows"] + n.get("Rows Removed by Filter", 0) for n in scans(plan))
            assert read <= 200, (read, index_conds(plan))
            before = sql.replace(pg_sql.LAPSED, "")
            assert before != sql
            taken = []
            for text in (sql, before):
                con.execute("BEGIN")
                try:
                    taken.append([(r[0], r[6]) for r in con.execute(text, run).fetchall()])
                finally:
                    con.execute("ROLLBACK")
            lapsed = [(seq, True) for seq in range(7, 20000, 2000)]
            assert taken[0] == taken[1] == lapsed + [(seq, False) for seq in range(20001, 20055)]


def test_with_statistics_taken_before_any_lease_a_settle_of_one_job_finds_it_by_id(url):
    """The same statistics: a settle of one job (a cycle's row by row) was planned as a walk
    of the leased entries of ``jobs_by_deadline`` (every lease, and under a held snapshot
    every dead version of one: 270 ms a settle).  It finds the job by its id."""
    with pg.connect(url) as con:
        leases_after_statistics(con)
        settle = {
            "id": "j99000",
            "status": "done",
            "reason": None,
            "available_at": None,
            "new_owner": None,
            "new_lease_until": None,
            "token": 1,
            "owner": "w",
            "attempt": 1,
            "lease_until": T0,
        }
        plan = executed_plan(con, STATEMENTS[w.SQL_SETTLE], settle)
        conds = index_conds(plan)
        assert plan["Plans"][0]["Actual Rows"] == 1, plan  # (the job, settled)
    assert len(conds) == 1 and conds[0].startswith("jobs_id_key: "), conds


def leases_after_statistics(con: psycopg.Connection[Any]) -> None:
    """Statistics taken over 96,000 done and 4,000 pending jobs, deadlines spread from T0,
    then the pending ones leased (owner ``w``, token 1, until T0): none leased, they say."""
    con.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")  # (the statistics stay)
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline) SELECT 'j' || i, 1, CASE WHEN i > 96000 THEN 'pending' ELSE 'done'"
        " END, 1, 3, 1, 0, %s + i FROM generate_series(1, 100000) AS i",
        (T0,),
    )
    con.execute("ANALYZE jobs")
    con.execute(
        "UPDATE jobs SET status = 'leased', owner = 'w', lease_until = %s WHERE seq > 96000",
        (T0,),
    )


async def filled(url: str, jobs: int) -> None:
    async with AsyncQueue.open(url) as q:
        await fill(q, [f"j{i:05}" for i in range(jobs)], w.epoch_ms())


def scans(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every index scan an executed plan ran."""
    found = [node] if "Index Name" in node and node["Actual Loops"] > 0 else []
    for child in node.get("Plans", ()):
        found += scans(child)
    return found


def index_conds(node: dict[str, Any]) -> list[str]:
    """The index conditions of every scan an executed plan ran (and the index's name)."""
    return [f"{n['Index Name']}: {n['Index Cond']}" for n in scans(node) if "Index Cond" in n]


def claimed(url: str, sql: str, params: dict[str, Any]) -> tuple[list[str], int]:
    """The jobs a claim (``sql``) takes with ``params`` (rolled back), and the entries of
    ``jobs_by_status`` its walk read (``idx_tup_read``: dead ones too)."""
    with psycopg.connect(url, autocommit=True) as con:
        con.execute(pg.SQL_CLAIMING)
        before = entries_read(con)
        con.execute("BEGIN")
        try:
            ids = [r[1] for r in con.execute(FLOORED[sql], params).fetchall()]
        finally:
            con.execute("ROLLBACK")
        return ids, entries_read(con) - before


def checked(url: str, params: dict[str, Any]) -> tuple[bool, int]:
    """What the quarantine's check from ``params`` finds, and the entries of every index of
    ``jobs`` it read."""
    with psycopg.connect(url, autocommit=True) as con:
        con.execute(pg.SQL_CLAIMING)
        before = entries_read(con, "%")
        [(found,)] = con.execute(FLOORED[DUE], params).fetchall()
        return found, entries_read(con, "%") - before


def entries_read(con: psycopg.Connection[Any], index: str = "jobs_by_status") -> int:
    """The entries read of ``index`` (a LIKE pattern: their sum) of ``jobs``."""
    con.execute("SELECT pg_stat_force_next_flush()")  # (this session's counts, flushed now)
    con.execute("SELECT pg_stat_clear_snapshot()")
    [(read,)] = con.execute(
        "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes"
        " WHERE relname = 'jobs' AND indexrelname LIKE %s",
        (index,),
    ).fetchall()
    return int(read)
