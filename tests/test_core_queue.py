"""Steps 2-6 and the additions (batches, extend): behaviour on real queue files and
PostgreSQL databases, through every driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from asnackq.core import worker as w

from .conftest import T0, Hooks, job, rows
from .drivers import BEGIN, DRIVERS, connect, on_pg, open_con, q


@pytest.fixture(params=DRIVERS)
def driver(request):
    return request.param


@pytest.fixture
def place(driver, tmp_path, request):
    """Fresh queue locations for the driver: files, or PostgreSQL databases."""
    if on_pg(driver):
        fresh = request.getfixturevalue("pg_db")
        return lambda name: fresh()
    return lambda name: tmp_path / f"{name}.db"


@pytest.fixture
def db(place):
    return place("queue")


@pytest.fixture
def file_db(tmp_path):
    return tmp_path / "queue.db"


@pytest.fixture
def con(driver, db):
    yield from connect(driver, db)


@pytest.fixture
def begin(driver):
    return BEGIN[driver]


def put(con, job_id, qty=1, now=T0, ttl=10_000, max_attempts=3):
    assert q.enqueue(con, {"id": job_id, "qty": qty}, now, ttl, max_attempts) is True


def visible_status(db, job_id):
    """What another connection sees right now (uncommitted changes are invisible)."""
    return job(db, job_id)["status"]


# --- open_queue ----------------------------------------------------------------


def test_open_queue_settings_schema_and_indexes(file_db):
    con = w.open_queue(file_db)
    try:
        assert con.isolation_level is None and not con.in_transaction
        assert con.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert con.execute("PRAGMA synchronous").fetchone() == (2,)
        assert con.execute("PRAGMA busy_timeout").fetchone() == (1000,)
        kinds = con.execute("SELECT type, name FROM sqlite_master ORDER BY name").fetchall()
        assert ("table", "jobs") in kinds and ("table", "redrives") in kinds
        sql = dict(con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
        assert sql["jobs"].startswith("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT")
    finally:
        con.close()


@pytest.mark.process
def test_open_queue_keeps_rows_across_reopen(driver, db):
    con = open_con(driver, Path(db) if driver == "sync" else db)
    put(con, "a", qty=4)
    put(con, "b", ttl=1)
    q.claim(con, "w1", T0 + 5)  # b dead by deadline, a leased
    q.redrive(con, "b", T0 + 10, 1000, "ops")
    before = rows(db)
    con.close()
    open_con(driver, str(db)).close()
    assert rows(db) == before


def test_claim_plan_does_not_scan_finished_rows(file_db):
    con = w.open_queue(file_db)
    plans = [
        " ".join(
            r[3] for r in con.execute("EXPLAIN QUERY PLAN " + sql, {"now": 1, "n": 8, "losses": 9})
        )
        for sql in (
            w.SQL_QUARANTINE,
            w.SQL_QUARANTINE_DUE,
            w.SQL_QUARANTINE_DUE_RECLAIMING,
            w.SQL_NEXT_CLAIMABLE,
            w.SQL_NEXT_RECLAIMABLE,
        )
    ]
    con.close()
    for plan in plans:
        assert "SCAN jobs" not in plan, plan


# --- enqueue ---------------------------------------------------------------------


@pytest.mark.process
def test_enqueue_inserts_pending_row(con, db):
    put(con, "a", qty=7, ttl=500, max_attempts=5)
    assert job(db, "a") == {
        "seq": 1,
        "id": "a",
        "qty": 7,
        "status": "pending",
        "attempts": 0,
        "max_attempts": 5,
        "token": 0,
        "available_at": T0,
        "deadline": T0 + 500,
        "owner": None,
        "lease_until": None,
        "reason": None,
    }


@pytest.mark.process
def test_duplicate_intake_keeps_whole_row(con, db):
    put(con, "a", qty=3)
    q.claim(con, "w1", T0)
    before = rows(db)
    assert q.enqueue(con, {"id": "a", "qty": 3}, T0 + 1, 60_000, 16) is False
    assert rows(db) == before


@pytest.mark.process
def test_conflicting_intake_raises_and_rolls_back(con, db, statements, begin):
    put(con, "a", qty=3)
    before = rows(db)
    statements.clear()
    with pytest.raises(w.Conflict):
        q.enqueue(con, {"id": "a", "qty": 4}, T0, 1000)
    assert rows(db) == before
    assert statements[0] == begin and statements[-1] == "ROLLBACK"


@pytest.mark.process
def test_every_operation_is_one_immediate_transaction(con, statements, begin):
    put(con, "a")
    calls = [
        lambda: q.enqueue(con, {"id": "a", "qty": 1}, T0, 1000),
        lambda: q.claim(con, "w1", T0),
        lambda: q.claim(con, "w1", T0),
        lambda: q.finish(
            con,
            {
                "id": "a",
                "qty": 1,
                "owner": "w1",
                "token": 1,
                "attempt": 1,
                "lease_until": T0 + 1000,
            },
            "permanent",
            T0 + 1,
        ),
        lambda: q.redrive(con, "a", T0 + 2, 1000, "ops"),
    ]
    for call in calls:
        statements.clear()
        call()
        control = [s for s in statements if s in (begin, "COMMIT", "ROLLBACK")]
        assert control == [begin, "COMMIT"], statements
        assert statements[0] == begin and statements[-1] == "COMMIT"


# --- claim -------------------------------------------------------------------------


@pytest.mark.process
def test_claim_returns_exact_ticket_and_leases(con, db):
    put(con, "a", qty=5)
    got = q.claim(con, "w1", T0 + 10, 250)
    assert got == {
        "id": "a",
        "qty": 5,
        "owner": "w1",
        "token": 1,
        "attempt": 1,
        "lease_until": T0 + 260,
    }
    row = job(db, "a")
    assert (row["status"], row["attempts"], row["token"], row["owner"], row["lease_until"]) == (
        "leased",
        1,
        1,
        "w1",
        T0 + 260,
    )


@pytest.mark.process
def test_claim_caps_lease_at_deadline_and_defaults_to_1000(con):
    put(con, "a", ttl=600)
    put(con, "b", ttl=5000)
    assert q.claim(con, "w1", T0)["lease_until"] == T0 + 600
    assert q.claim(con, "w1", T0)["lease_until"] == T0 + 1000


@pytest.mark.process
def test_claim_on_empty_queue_is_none(con):
    assert q.claim(con, "w1", T0) is None


@pytest.mark.process
def test_claim_takes_lowest_seq_not_lowest_id(con):
    for job_id in ("z", "a", "m"):
        put(con, job_id)
    assert [q.claim(con, "w1", T0)["id"] for _ in range(3)] == ["z", "a", "m"]


@pytest.mark.process
def test_claim_available_at_is_inclusive(con):
    put(con, "a", now=T0 + 5)
    assert q.claim(con, "w1", T0 + 4) is None
    assert q.claim(con, "w1", T0 + 5)["id"] == "a"


@pytest.mark.process
def test_claim_takes_over_an_expired_lease_at_equality(con, db):
    put(con, "a")
    first = q.claim(con, "w1", T0, 100)
    assert q.claim(con, "w2", T0 + 99) is None
    second = q.claim(con, "w2", T0 + 100)
    assert (second["token"], second["attempt"], second["owner"]) == (2, 2, "w2")
    assert first["token"] == 1


@pytest.mark.process
def test_claim_interleaves_pending_and_expired_leases_by_seq(con):
    put(con, "a")
    put(con, "b")
    q.claim(con, "w1", T0, 10)  # a leased until T0+10
    put(con, "c")
    assert q.claim(con, "w2", T0 + 10)["id"] == "a"  # expired a before pending b
    assert q.claim(con, "w2", T0 + 10)["id"] == "b"


@pytest.mark.process
def test_claim_quarantines_deadline_before_exhausted(con, db):
    put(con, "late", ttl=100)
    put(con, "spent", ttl=10_000, max_attempts=1)
    put(con, "both", ttl=100, max_attempts=1)
    q.claim(con, "w1", T0, 50)  # late
    q.claim(con, "w1", T0, 50)  # spent (attempt 1 of 1)
    q.claim(con, "w1", T0, 50)  # both
    assert q.claim(con, "w1", T0 + 100) is None
    assert [
        (job(db, i)["status"], job(db, i)["reason"], job(db, i)["owner"], job(db, i)["lease_until"])
        for i in ("late", "spent", "both")
    ] == [
        ("dead", "deadline", None, None),
        ("dead", "exhausted", None, None),
        ("dead", "deadline", None, None),
    ]


@pytest.mark.process
def test_claim_quarantines_pending_at_deadline_equality(con, db):
    put(con, "a", ttl=10)
    assert q.claim(con, "w1", T0 + 10) is None
    assert (job(db, "a")["status"], job(db, "a")["reason"]) == ("dead", "deadline")


@pytest.mark.process
def test_claim_never_quarantines_a_live_lease(con, db):
    put(con, "a", ttl=100, max_attempts=1)
    q.claim(con, "w1", T0, 100)  # lease_until = deadline = T0+100, attempts = max
    assert q.claim(con, "w2", T0 + 99) is None
    assert job(db, "a")["status"] == "leased"


@pytest.mark.process
def test_quarantine_commits_without_hooks_when_nothing_is_claimable(con, db):
    put(con, "a", ttl=10)
    hooks = Hooks(fail_at="after-claim")
    assert q.claim(con, "w1", T0 + 10, fault=hooks) is None
    assert hooks.points == []
    assert job(db, "a")["status"] == "dead"


@pytest.mark.process
def test_claim_hooks_in_order_inside_then_after_commit(con, db):
    put(con, "a")
    seen = []
    hooks = Hooks(action=lambda p: seen.append((p, con.in_transaction, visible_status(db, "a"))))
    q.claim(con, "w1", T0, fault=hooks)
    assert seen == [("after-claim", True, "pending"), ("after-commit", False, "leased")]


class Abort(BaseException):
    """Not an Exception, like KeyboardInterrupt (which asyncio re-raises out of its loop)."""


@pytest.mark.process
@pytest.mark.parametrize("error", [RuntimeError("after-claim"), Abort()])
def test_claim_fault_before_commit_rolls_back_quarantine_too(con, db, error):
    put(con, "old", ttl=5)
    put(con, "a")
    before = rows(db)

    def fault(point):
        raise error

    with pytest.raises(type(error)) as raised:
        q.claim(con, "w1", T0 + 5, fault=fault)
    assert raised.value is error
    assert rows(db) == before


@pytest.mark.process
def test_claim_fault_after_commit_keeps_the_claim(con, db):
    put(con, "a")
    with pytest.raises(RuntimeError, match="after-commit"):
        q.claim(con, "w1", T0, fault=Hooks(fail_at="after-commit"))
    assert job(db, "a")["status"] == "leased"


# --- finish ---------------------------------------------------------------------------


@pytest.fixture
def leased(con):
    put(con, "a", qty=2, ttl=10_000, max_attempts=3)
    return q.claim(con, "w1", T0, 1000)


@pytest.mark.parametrize(
    ("outcome", "delay", "expected"),
    [
        ("ok", 0, ("done", None, T0 + 7)),
        ("ok", 500, ("done", None, T0 + 7)),
        ("permanent", 500, ("dead", "permanent", T0 + 7)),
        ("retry", 500, ("pending", "retry", T0 + 507)),
    ],
)
@pytest.mark.process
def test_finish_outcomes(con, db, leased, outcome, delay, expected):
    before = job(db, "a")
    assert q.finish(con, leased, outcome, T0 + 7, delay) == expected[0]
    after = job(db, "a")
    assert (after["status"], after["reason"], after["available_at"]) == expected
    assert after["owner"] is None and after["lease_until"] is None
    for kept in ("seq", "qty", "attempts", "max_attempts", "token", "deadline"):
        assert after[kept] == before[kept]


@pytest.mark.process
def test_finish_retry_at_deadline_equality_is_dead(con, db):
    put(con, "d", ttl=1000)
    issued = q.claim(con, "w1", T0, 1000)
    assert q.finish(con, issued, "retry", T0 + 400, 600) == "dead"
    assert job(db, "d")["reason"] == "deadline"
    assert job(db, "d")["available_at"] == T0 + 400


@pytest.mark.process
def test_finish_retry_one_before_deadline_is_pending(con, db):
    put(con, "d", ttl=1000)
    issued = q.claim(con, "w1", T0, 1000)
    assert q.finish(con, issued, "retry", T0 + 400, 599) == "pending"


@pytest.mark.process
def test_finish_retry_exhausted_wins_over_deadline(con, db):
    put(con, "e", ttl=1000, max_attempts=1)
    issued = q.claim(con, "w1", T0)
    assert q.finish(con, issued, "retry", T0 + 1, 60_000) == "dead"
    assert job(db, "e")["reason"] == "exhausted"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", "b"),
        ("qty", 3),
        ("owner", "w2"),
        ("token", 2),
        ("attempt", 2),
        ("lease_until", T0 + 999),
    ],
)
@pytest.mark.process
def test_finish_rejects_any_ticket_mismatch(con, db, leased, field, value):
    put(con, "b", qty=2)
    before = rows(db)
    assert q.finish(con, {**leased, field: value}, "ok", T0 + 1) is False
    assert rows(db) == before


@pytest.mark.process
def test_finish_rejects_at_lease_end_and_at_deadline(con, db, leased):
    before = rows(db)
    hooks = Hooks()
    assert q.finish(con, leased, "ok", T0 + 1000, fault=hooks) is False
    put(con, "short", ttl=300)
    short = q.claim(con, "w1", T0, 1000)  # lease capped at the deadline
    assert q.finish(con, {**short, "lease_until": T0 + 300}, "ok", T0 + 300) is False
    assert hooks.points == []
    assert rows(db)[0] == before[0]


@pytest.mark.process
def test_stale_same_owner_cannot_finish_a_newer_lease(con, db, leased):
    newer = q.claim(con, "w1", T0 + 1000, 1000)
    assert newer["token"] == 2
    assert q.finish(con, leased, "ok", T0 + 1001) is False
    assert q.finish(con, newer, "ok", T0 + 1001) == "done"
    assert q.finish(con, newer, "ok", T0 + 1002) is False  # not leased any more


@pytest.mark.process
def test_finish_hooks_and_faults(con, db, leased):
    seen = []
    hooks = Hooks(action=lambda p: seen.append((p, visible_status(db, "a"))))
    with pytest.raises(RuntimeError, match="after-finish"):
        q.finish(con, leased, "ok", T0 + 1, fault=Hooks(fail_at="after-finish"))
    assert job(db, "a")["status"] == "leased"
    with pytest.raises(RuntimeError, match="after-commit"):
        q.finish(con, leased, "ok", T0 + 1, fault=Hooks(fail_at="after-commit"))
    assert job(db, "a")["status"] == "done"
    assert q.finish(con, leased, "ok", T0 + 2, fault=hooks) is False
    assert seen == []


@pytest.mark.process
def test_finish_hook_positions(con, db, leased):
    seen = []
    q.finish(
        con,
        leased,
        "retry",
        T0 + 1,
        10,
        fault=lambda p: seen.append((p, con.in_transaction, visible_status(db, "a"))),
    )
    assert seen == [("after-finish", True, "leased"), ("after-commit", False, "pending")]


TICKET = {"id": "a", "qty": 1, "owner": "w1", "token": 1, "attempt": 1, "lease_until": T0 + 9}
BAD_LIMITS = w.Limits(ttl_ms=None)  # type: ignore[arg-type]  # (its max_now raises TypeError)


@pytest.mark.parametrize(
    ("results", "says"),
    [
        ([], "finish_many needs at least one result"),
        ([({"id": "a"}, "ok", T0, 0)], "ticket must be a dict"),
        ([({**TICKET, "qty": 0}, "ok", T0, 0)], "ticket qty must be an int in 1..1000: 0"),
        ([(TICKET, "done", T0, 0)], "outcome must be one of"),
    ],
)
def test_batched_finishes_report_their_inputs_before_the_limits_are_read(file_db, results, says):
    """A finish's ticket and outcome are checked before anything of its Limits is read, as
    ``check_finish`` checks them: a bad one is named even under Limits that cannot be read."""
    con = w.open_queue(file_db)
    put(con, "a")
    before = rows(file_db)
    plans = [lambda: w.plan_finish_many(iter(results), limits=BAD_LIMITS)]
    if results:
        plans.append(lambda: w.plan_cycle(iter(results), [], "w1", T0, 1, 0, limits=BAD_LIMITS))
    for plan in plans:
        with pytest.raises(ValueError, match=says):
            w.drive(con, plan())
    con.close()
    assert rows(file_db) == before


# --- redrive ------------------------------------------------------------------------------


@pytest.mark.process
def test_redrive_renews_budget_keeps_token_and_audits(con, db):
    put(con, "a", qty=9, ttl=10_000, max_attempts=2)
    issued = q.claim(con, "w1", T0)
    q.finish(con, issued, "permanent", T0 + 1)
    hooks = Hooks()
    assert q.redrive(con, "a", T0 + 50, 700, "ops-fix", fault=hooks) is True
    assert hooks.points == ["after-audit", "after-redrive", "after-commit"]
    row = job(db, "a")
    assert {k: row[k] for k in row if k != "seq"} == {
        "id": "a",
        "qty": 9,
        "status": "pending",
        "attempts": 0,
        "max_attempts": 2,
        "token": 1,
        "available_at": T0 + 50,
        "deadline": T0 + 750,
        "owner": None,
        "lease_until": None,
        "reason": None,
    }
    assert rows(db)[-1] == (1, "a", 1, T0 + 50, "ops-fix")
    assert q.claim(con, "w2", T0 + 50)["token"] == 2  # never a reused generation


@pytest.mark.process
@pytest.mark.parametrize("state", ["missing", "pending", "leased", "done"])
def test_redrive_refuses_a_job_that_is_not_dead(con, db, state, statements):
    put(con, "a")
    if state in ("leased", "done"):
        issued = q.claim(con, "w1", T0)
        if state == "done":
            q.finish(con, issued, "ok", T0 + 1)
    before = rows(db)
    statements.clear()
    with pytest.raises(ValueError, match=r"redrive|not dead"):
        q.redrive(con, "zz" if state == "missing" else "a", T0 + 2, 1000, "ops", fault=Hooks())
    assert rows(db) == before
    assert statements[-1] == "ROLLBACK"


@pytest.mark.process
@pytest.mark.parametrize("point", ["after-audit", "after-redrive"])
def test_redrive_fault_before_commit_leaves_no_half_redrive(con, db, point):
    put(con, "a", ttl=1)
    q.claim(con, "w1", T0 + 1)
    before = rows(db)
    with pytest.raises(RuntimeError, match=point):
        q.redrive(con, "a", T0 + 2, 1000, "ops", fault=Hooks(fail_at=point))
    assert rows(db) == before


@pytest.mark.process
def test_redrive_hook_positions_and_after_commit_fault(con, db):
    put(con, "a", ttl=1)
    q.claim(con, "w1", T0 + 1)

    def audit_rows():
        return len(rows(db)) - rows(db).index(("--",)) - 1

    seen = []
    hooks = Hooks(
        fail_at="after-commit",
        action=lambda p: seen.append((p, visible_status(db, "a"), audit_rows())),
    )
    with pytest.raises(RuntimeError, match="after-commit"):
        q.redrive(con, "a", T0 + 2, 1000, "ops", fault=hooks)
    assert seen == [
        ("after-audit", "dead", 0),
        ("after-redrive", "dead", 0),
        ("after-commit", "pending", 1),
    ]


# --- additions: extend and batches ------------------------------------------------------------


@pytest.mark.process
def test_extend_is_fenced_and_capped_at_the_deadline(con, db):
    put(con, "a", ttl=3000)
    issued = q.claim(con, "w1", T0, 1000)
    longer = q.extend(con, issued, T0 + 500, 2000)
    assert longer == {**issued, "lease_until": T0 + 2500}
    assert q.extend(con, issued, T0 + 600, 2000) is False  # old ticket is stale
    capped = q.extend(con, longer, T0 + 2000, 60_000)
    assert capped["lease_until"] == T0 + 3000
    assert q.finish(con, capped, "ok", T0 + 2999) == "done"


@pytest.mark.process
def test_extend_never_shortens_and_refuses_expired(con):
    put(con, "a")
    issued = q.claim(con, "w1", T0, 1000)
    assert q.extend(con, issued, T0 + 1, 10)["lease_until"] == T0 + 1000
    assert q.extend(con, issued, T0 + 1000, 1000) is False


@pytest.mark.process
def test_claim_many_is_identical_to_sequential_claims(driver, place):
    where = {"one": place("one"), "many": place("many")}

    def fill(path):
        con = open_con(driver, path)
        for i, ttl in enumerate([5, 10_000, 10_000, 10_000, 10_000]):
            put(con, f"j{i}", qty=i + 1, ttl=ttl)
        return con

    one, many = fill(where["one"]), fill(where["many"])
    sequential = [q.claim(one, "w1", T0 + 5, 700) for _ in range(3)]
    batch = q.claim_many(many, "w1", T0 + 5, 700, 3)
    assert batch == sequential
    assert rows(where["one"]) == rows(where["many"])
    assert len(q.claim_many(many, "w1", T0 + 5, 700, 10)) == 1
    assert q.claim_many(many, "w1", T0 + 5, 700, 10) == []
    one.close()
    many.close()


@pytest.mark.process
def test_finish_many_fences_each_ticket_on_its_own(con, db):
    for job_id in ("a", "b", "c"):
        put(con, job_id)
    tickets = q.claim_many(con, "w1", T0, 1000, 3)
    stale = {**tickets[1], "token": 9}
    got = q.finish_many(
        con,
        [
            (tickets[0], "ok", T0 + 1, 0),
            (stale, "ok", T0 + 1, 0),
            (tickets[2], "retry", T0 + 1, 100),
        ],
    )
    assert got == ["done", False, "pending"]
    assert [job(db, i)["status"] for i in "abc"] == ["done", "leased", "pending"]


@pytest.mark.process
def test_enqueue_many_judges_each_item_like_sequential_enqueues(con, db):
    put(con, "old", qty=5)
    items = [
        ({"id": "a", "qty": 1}, 1000, 3),
        ({"id": "old", "qty": 5}, 1000, 3),
        ({"id": "old", "qty": 6}, 1000, 3),
        ({"id": "a", "qty": 1}, 9000, 7),
        ({"id": "a", "qty": 2}, 1000, 3),
        ({"id": "b", "qty": 3}, 2000, 16),
    ]
    got = q.enqueue_many(con, items, T0 + 1)
    assert got[:2] == [True, False] and got[3] is False and got[5] is True
    assert [type(r) for r in (got[2], got[4])] == [w.Conflict, w.Conflict]
    assert "exists with qty 5, not 6" in str(got[2])
    assert job(db, "a")["deadline"] == T0 + 1001 and job(db, "a")["max_attempts"] == 3
    assert job(db, "b")["max_attempts"] == 16 and job(db, "old")["qty"] == 5


@pytest.mark.process
def test_enqueue_many_validates_every_item_before_any_change(con, db):
    before = rows(db)
    with pytest.raises(ValueError):
        q.enqueue_many(con, [({"id": "a", "qty": 1}, 1000, 3), ({"id": "b", "qty": 1}, 0, 3)], T0)
    with pytest.raises(ValueError):
        q.enqueue_many(con, [], T0)
    assert rows(db) == before


@pytest.mark.process
def test_large_batches_equal_sequential_calls(driver, place):
    where = {"one": place("one"), "many": place("many")}
    count = 211  # one set-based lease statement, whatever the count

    def fill(path):
        con = open_con(driver, path)
        assert all(
            q.enqueue_many(
                con,
                [  # some deadlines fall inside the lease
                    (
                        {"id": f"j{i}", "qty": i % 9 + 1},
                        300 if i % 11 == 0 else 10_000,
                        1 if i % 13 == 0 else 3,
                    )
                    for i in range(count)
                ],
                T0,
            )
        )
        assert len(q.claim_many(con, "w0", T0, 100, 50)) == 50  # expire, then reclaimed
        return con

    one, many = fill(where["one"]), fill(where["many"])
    sequential = [q.claim(one, "w1", T0 + 100, 700) for _ in range(count)]
    sequential = sequential[: sequential.index(None)]  # the jobs whose budget is spent are dead
    assert len(sequential) > 190
    assert q.claim_many(many, "w1", T0 + 100, 700, count) == sequential
    assert rows(where["one"]) == rows(where["many"])
    for ticket in sequential:  # each row is exactly the lease its ticket names
        row = job(where["many"], ticket["id"])
        assert (row["status"], row["owner"], row["token"], row["attempts"], row["lease_until"]) == (
            "leased",
            "w1",
            ticket["token"],
            ticket["attempt"],
            ticket["lease_until"],
        )
    assert {t["lease_until"] for t in sequential} == {T0 + 300, T0 + 800}  # capped: deadline
    results = []
    for i, ticket in enumerate(sequential):
        results.append((ticket, ("ok", "retry", "permanent")[i % 3], T0 + 200 + i % 500, i % 4))
        if i % 17 == 0:  # a replay and a forged token: stale
            results += [(ticket, "ok", T0 + 201, 0), ({**ticket, "token": 99}, "ok", T0 + 201, 0)]
    expected = [q.finish(one, *result) for result in results]
    assert q.finish_many(many, results) == expected
    assert expected.count(False) > 2 * len(results) // 17 and {"done", "pending", "dead"} <= {
        *expected
    }
    assert rows(where["one"]) == rows(where["many"])
    one.close()
    many.close()


@pytest.mark.process
def test_extend_many_is_identical_to_sequential_extends(driver, place):
    where = {"one": place("one"), "many": place("many")}

    def fill(path):
        con = open_con(driver, path)
        q.enqueue_many(
            con, [({"id": f"j{i}", "qty": 1}, 450 if i == 3 else 10_000, 3) for i in range(6)], T0
        )
        return con, q.claim_many(con, "w1", T0, 500, 6)

    (one, tickets), (many, same) = fill(where["one"]), fill(where["many"])
    assert tickets == same
    forged = {**tickets[1], "token": 5}
    # A replay of an extended ticket, a forged token, a lease capped at its deadline twice
    # (sequentially both extends land), a ticket already expired, a missing job.
    batch = [
        tickets[0],
        tickets[0],
        forged,
        tickets[3],
        tickets[3],
        tickets[4],
        {**tickets[5], "id": "ghost"},
    ]
    expected = [q.extend(one, t, T0 + 400, 500) for t in batch]
    assert q.extend_many(many, batch, T0 + 400, 500) == expected
    assert [x if x is False else x["lease_until"] for x in expected] == [
        T0 + 900,
        False,
        False,
        T0 + 450,
        T0 + 450,
        T0 + 900,
        False,
    ]
    assert rows(where["one"]) == rows(where["many"])
    assert q.extend_many(many, [tickets[2]], T0 + 500, 500) == [False]  # lease end: stale
    with pytest.raises(ValueError):
        q.extend_many(many, [], T0, 500)
    one.close()
    many.close()


@pytest.mark.process
def test_cycle_is_finish_many_then_extend_many_then_claim_many(driver, place):
    where = {"one": place("one"), "many": place("many")}

    def fill(path):
        con = open_con(driver, path)
        q.enqueue_many(con, [({"id": f"j{i}", "qty": i + 1}, 10_000, 2) for i in range(8)], T0)
        return con, q.claim_many(con, "w1", T0, 500, 5)

    (one, tickets), (many, _) = fill(where["one"]), fill(where["many"])
    results = [
        (tickets[0], "ok", T0 + 1, 0),
        (tickets[1], "retry", T0 + 1, 0),
        ({**tickets[2], "owner": "w9"}, "ok", T0 + 1, 0),
    ]
    held = [tickets[2], tickets[3], tickets[0]]  # j0 was just finished: stale
    expected = (
        q.finish_many(one, results),
        q.extend_many(one, held, T0 + 300, 500),
        q.claim_many(one, "w2", T0 + 300, 500, 3),
        {},
    )
    got = q.cycle(many, results, held, "w2", T0 + 300, 500, 3)
    assert got == expected and expected[0] == ["done", "pending", False]
    assert [x if x is False else x["lease_until"] for x in got[1]] == [T0 + 800, T0 + 800, False]
    assert [t["id"] for t in got[2]] == ["j1", "j5", "j6"]
    assert rows(where["one"]) == rows(where["many"])
    assert q.cycle(many, [], [], "w2", T0 + 301, 500, 0) == ([], [], [], {})
    before = rows(where["many"])
    for bad in (
        ([(tickets[4], "ok", T0, 0)], [], "w2", T0, 500, -1),
        ([], [{**tickets[4], "qty": 0}], "w2", T0, 500, 1),
    ):
        with pytest.raises(ValueError):
            q.cycle(many, *bad)
    assert rows(where["many"]) == before
    one.close()
    many.close()


@pytest.mark.process
def test_a_cycles_claims_ahead_take_only_jobs_never_attempted(driver, place):
    where = place("q")
    con = open_con(driver, where)
    q.enqueue_many(con, [({"id": f"j{i}", "qty": 1}, 10_000, 3) for i in range(8)], T0)
    q.claim_many(con, "w1", T0, 100, 2)  # j0, j1: their leases end at T0 + 100
    retried = q.claim(con, "w1", T0, 500)  # j2: back to pending, one attempt spent
    q.finish(con, retried, "retry", T0 + 1, 0)
    _, _, tickets, _ = q.cycle(con, [], [], "w2", T0 + 200, 500, 1, 3)
    assert [(t["id"], t["attempt"]) for t in tickets] == [
        ("j0", 2),  # the claim for a waiting coroutine: any claimable job
        ("j3", 1),  # ahead of demand: only jobs never attempted
        ("j4", 1),
        ("j5", 1),
    ]
    assert [t["id"] for t in q.cycle(con, [], [], "w2", T0 + 200, 500, 0, 5)[2]] == ["j6", "j7"]
    assert [t["id"] for t in q.cycle(con, [], [], "w2", T0 + 200, 500, 3, 1)[2]] == ["j1", "j2"]
    before = rows(where)
    for fresh in (-1, 1025, True):
        with pytest.raises(ValueError, match="fresh"):
            q.cycle(con, [], [], "w2", T0 + 200, 500, 0, fresh)
    assert rows(where) == before
    con.close()
