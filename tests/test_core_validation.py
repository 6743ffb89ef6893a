"""Step 1 and the value rules: exact types, inclusive bounds, bool rejected, nothing touched."""

from __future__ import annotations

import enum
import sqlite3
from pathlib import Path

import pytest

from asnackq.core import worker as w

from .conftest import T0, rows
from .drivers import AioBridge, connect, q


class MyStr(str):
    pass


class MyInt(int):
    pass


class MyDict(dict):  # type: ignore[type-arg]
    pass


class Level(enum.IntEnum):
    ONE = 1


BAD_IDS = ["", "a" * 65, "é", "ab c", "a\n", "a/b", "a.b", MyStr("a"), 1, None, b"a", "ａ", "٣"]
GOOD_IDS = ["a", "a" * 64, "A-z_0-9", "-", "_"]
BAD_TIMES = [-1, w.MAX_NOW + 1, True, False, 1.0, "1", None, MyInt(5)]


@pytest.mark.parametrize(
    ("attempt", "base", "cap", "jitter", "expected"),
    [
        (1, 100, 1000, 1, 100),
        (2, 100, 1000, 1, 200),
        (4, 100, 1000, 1, 800),
        (5, 100, 1000, 1, 1000),
        (16, 100, 1000, 1.0, 1000),
        (16, 60_000, 60_000, 1, 60_000),
        (3, 100, 1000, 0.5, 200),
        (1, 100, 1000, 0, 0),
        (1, 1, 1, 0.999, 0),
        (2, 100, 1000, 0.29, 57),
        (5, 100, 1000, 0.29, 290),
        (1, 100, 100, 0.3333, 33),
    ],
)
def test_retry_delay_caps_first_then_applies_jitter(attempt, base, cap, jitter, expected):
    # The contract's formula in float arithmetic: 200 * 0.29 == 57.99999999999999 -> 57.
    assert w.retry_delay(attempt, base, cap, jitter) == expected


@pytest.mark.parametrize(
    "args",
    [
        (0, 100, 1000, 1),
        (17, 100, 1000, 1),
        (True, 100, 1000, 1),
        (1.0, 100, 1000, 1),
        (1, 0, 1000, 1),
        (1, 60_001, 60_001, 1),
        (1, True, 1000, 1),
        (1, MyInt(1), 1000, 1),
        (1, 100, 99, 1),
        (1, 100, 60_001, 1),
        (1, 100, True, 1),
        (Level.ONE, 100, 1000, 1),
        (1, 100, 1000, -0.0001),
        (1, 100, 1000, 1.0001),
        (1, 100, 1000, 2),
        (1, 100, 1000, True),
        (1, 100, 1000, False),
        (1, 100, 1000, float("nan")),
        (1, 100, 1000, float("inf")),
        (1, 100, 1000, "0.5"),
        (1, 100, 1000, None),
        (1, 100, 1000, 10**400),
    ],
)
def test_retry_delay_rejects_bad_input(args):
    with pytest.raises(ValueError):
        w.retry_delay(*args)


@pytest.fixture(params=["sync", "aio"])
def con(request, db):
    yield from connect(request.param, db)


def test_exceptions_are_distinct_exception_subclasses():
    classes = [w.Conflict, w.Retryable, w.Permanent, w.BadAck]
    assert all(issubclass(cls, Exception) for cls in classes)
    assert len({cls for cls in classes}) == 4
    assert not any(issubclass(a, b) for a in classes for b in classes if a is not b)


@pytest.mark.parametrize("bad", BAD_IDS)
def test_identifier_rule_rejects(con, db, bad):
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 1000)
    before = rows(db)
    for call in (
        lambda: q.enqueue(con, {"id": bad, "qty": 1}, T0, 1000),
        lambda: q.claim(con, bad, T0 + 5_000),  # quarantine would have changed "a"
        lambda: q.redrive(con, bad, T0, 1000, "ops"),
        lambda: q.redrive(con, "a", T0, 1000, bad),
    ):
        with pytest.raises(ValueError):
            call()
    assert rows(db) == before


@pytest.mark.parametrize("good", GOOD_IDS)
def test_identifier_rule_accepts(con, good):
    assert q.enqueue(con, {"id": good, "qty": 1}, T0, 1000) is True
    assert q.claim(con, good, T0)["owner"] == good


@pytest.mark.parametrize(
    "event",
    [
        {"id": "a"},
        {"qty": 1},
        {"id": "a", "qty": 1, "extra": 0},
        MyDict(id="a", qty=1),
        [("id", "a"), ("qty", 1)],
        None,
        {"id": "a", "qty": 0},
        {"id": "a", "qty": 1001},
        {"id": "a", "qty": True},
        {"id": "a", "qty": 1.0},
        {"id": "a", "qty": MyInt(1)},
    ],
)
def test_enqueue_rejects_bad_events(con, db, event):
    with pytest.raises(ValueError):
        q.enqueue(con, event, T0, 1000)
    assert rows(db) == [("--",)]


@pytest.mark.parametrize(
    ("now", "ttl", "max_attempts"),
    [
        *[(bad, 1000, 3) for bad in BAD_TIMES],
        (T0, 0, 3),
        (T0, 60_001, 3),
        (T0, True, 3),
        (T0, 1000, 0),
        (T0, 1000, 17),
        (T0, 1000, True),
    ],
)
def test_enqueue_rejects_bad_numbers(con, db, now, ttl, max_attempts):
    if now is None and isinstance(con, AioBridge):
        pytest.skip("AsyncQueue reads its clock for a missing now_ms (test_aio_defaults.py)")
    with pytest.raises(ValueError):
        q.enqueue(con, {"id": "a", "qty": 1}, now, ttl, max_attempts)
    assert rows(db) == [("--",)]


def test_enqueue_accepts_every_inclusive_bound(con, db):
    assert q.enqueue(con, {"id": "lo", "qty": 1}, 0, 1, 1)
    assert q.enqueue(con, {"id": "hi", "qty": 1000}, w.MAX_NOW, 60_000, 16)
    assert rows(db)[1][1:] == ("hi", 1000, "pending", 0, 16, 0, w.MAX_NOW, 10**15, None, None, None)


@pytest.mark.parametrize(
    ("now", "lease", "fault"),
    [
        *[(bad, 1000, None) for bad in BAD_TIMES],
        (T0, 0, None),
        (T0, 60_001, None),
        (T0, True, None),
        (T0, 1000.0, None),
        (T0, 1000, "after-claim"),
        (T0, 1000, 1),
    ],
)
def test_claim_rejects_bad_arguments_before_quarantine(con, db, now, lease, fault):
    q.enqueue(con, {"id": "a", "qty": 1}, T0 - 10, 1)  # quarantine-ready
    before = rows(db)
    with pytest.raises(ValueError):
        q.claim(con, "w1", now, lease, fault)
    assert rows(db) == before


def ticket(**change):
    base = {"id": "a", "qty": 1, "owner": "w1", "token": 1, "attempt": 1, "lease_until": T0 + 1000}
    return {**base, **change}


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {k: v for k, v in ticket().items() if k != "attempt"},
        {**ticket(), "extra": 1},
        MyDict(ticket()),
        ticket(id="a b"),
        ticket(owner=""),
        ticket(qty=0),
        ticket(qty=1001),
        ticket(qty=True),
        ticket(token=0),
        ticket(token=10**15 + 1),
        ticket(token=True),
        ticket(attempt=0),
        ticket(attempt=17),
        ticket(attempt=1.0),
        ticket(lease_until=0),
        ticket(lease_until=10**15 + 1),
        ticket(lease_until=False),
        None,
    ],
)
def test_finish_rejects_bad_tickets(con, db, bad):
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 1000)
    q.claim(con, "w1", T0)
    before = rows(db)
    with pytest.raises(ValueError):
        q.finish(con, bad, "ok", T0 + 1)
    assert rows(db) == before


@pytest.mark.parametrize(
    ("outcome", "now", "delay", "fault"),
    [
        ("OK", T0, 0, None),
        ("done", T0, 0, None),
        (MyStr("ok"), T0, 0, None),
        (None, T0, 0, None),
        ("ok", -1, 0, None),
        ("ok", True, 0, None),
        ("ok", T0, -1, None),
        ("ok", T0, 60_001, None),
        ("ok", T0, True, None),
        ("ok", T0, 0, "hook"),
    ],
)
def test_finish_rejects_bad_arguments(con, db, outcome, now, delay, fault):
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 1000)
    issued = q.claim(con, "w1", T0)
    before = rows(db)
    with pytest.raises(ValueError):
        q.finish(con, issued, outcome, now, delay, fault)
    assert rows(db) == before


def test_finish_accepts_ticket_bounds(con):
    q.enqueue(con, {"id": "a", "qty": 1000}, w.MAX_NOW - 1, 60_000)
    # Not leased with these values, so stale - but the values themselves are valid.
    big = ticket(qty=1000, token=10**15, attempt=16, lease_until=10**15)
    assert q.finish(con, big, "ok", w.MAX_NOW) is False
    assert q.finish(con, ticket(lease_until=1), "retry", 0, 60_000) is False


@pytest.mark.parametrize(
    ("job_id", "now", "ttl", "note"),
    [
        ("a", -1, 1000, "ops"),
        ("a", T0, 0, "ops"),
        ("a", T0, 60_001, "ops"),
        ("a", T0, True, "ops"),
        ("a", T0, 1000, "two words"),
        ("a", T0, 1000, ""),
        ("a", T0, 1000, None),
    ],
)
def test_redrive_rejects_bad_arguments(con, db, job_id, now, ttl, note):
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 1, 1)
    q.claim(con, "w1", T0 + 1)  # quarantines "a" as dead/deadline
    before = rows(db)
    with pytest.raises(ValueError):
        q.redrive(con, job_id, now, ttl, note)
    assert rows(db) == before


def test_validation_errors_reach_no_statement(con, statements):
    for call in (
        lambda: q.enqueue(con, {"id": "a", "qty": False}, T0, 1000),
        lambda: q.claim(con, "w1", T0, lease_ms=0),
        lambda: q.finish(con, {}, "ok", T0),
        lambda: q.redrive(con, "a", T0, 1000, "no note"),
        lambda: q.extend(con, ticket(), T0, 0),
    ):
        with pytest.raises(ValueError):
            call()
    assert statements == []


def test_inputs_are_never_mutated(con):
    event = {"id": "a", "qty": 2}
    q.enqueue(con, event, T0, 1000)
    assert event == {"id": "a", "qty": 2}
    issued = q.claim(con, "w1", T0)
    copy = dict(issued)
    assert q.extend(con, issued, T0 + 1, 2000) is not issued
    assert issued == copy


@pytest.mark.parametrize("path", [":memory:", "", 7, None, b"q.db", "a\0b"])
def test_open_queue_rejects_non_files(path):
    with pytest.raises(ValueError):
        w.open_queue(path)


def test_open_queue_closes_connection_when_initialisation_fails(tmp_path: Path, monkeypatch):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database at all " * 200)
    opened: list[sqlite3.Connection] = []
    real_connect = sqlite3.connect

    def spy(*args, **kwargs):
        opened.append(real_connect(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", spy)
    with pytest.raises(sqlite3.DatabaseError):
        w.open_queue(garbage)
    with pytest.raises(sqlite3.ProgrammingError):
        opened[0].execute("SELECT 1")


@pytest.mark.process
def test_core_loads_by_path_with_the_standard_library_alone():
    import subprocess
    import sys

    path = Path(w.__file__)
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('w', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); "
        "print(sorted(k for k in sys.modules if k.startswith('asnackq')))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.strip() == "[]"
