"""Steps 7-8 in one process: run_once's classification and run_file's ownership."""

from __future__ import annotations

import sqlite3

import pytest

from asnackq.core import worker as w

from .conftest import T0, Clock, job


class Sender:
    """A send callable that records its calls and answers with a value or an exception."""

    def __init__(self, answer=True, during=None):
        self.answer = answer
        self.during = during
        self.calls: list[dict] = []

    def __call__(self, event):
        self.calls.append(dict(event))
        if self.during is not None:
            self.during(event)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def put(con, job_id="a", qty=3, ttl=10_000, max_attempts=3, now=T0):
    w.enqueue(con, {"id": job_id, "qty": qty}, now, ttl, max_attempts)


def test_empty_queue_sends_nothing(con):
    send, clock = Sender(), Clock(T0)
    assert w.run_once(con, "w1", clock, send, 0.5) is None
    assert send.calls == [] and clock.calls == 1


def test_ok_delivery_sends_a_fresh_id_qty_dict_outside_any_transaction(con, db):
    put(con, qty=4)
    seen = {}

    def during(event):
        other = sqlite3.connect(db, timeout=0)
        try:
            other.execute("BEGIN IMMEDIATE")  # the write lock is free during the send
            other.execute("ROLLBACK")
        finally:
            other.close()
        seen["in_transaction"] = con.in_transaction
        seen["type"] = type(event)

    send = Sender(True, during)
    assert w.run_once(con, "w1", Clock(T0, T0 + 10), send, 0.5) == {
        "id": "a",
        "token": 1,
        "status": "done",
    }
    assert send.calls == [{"id": "a", "qty": 4}]
    assert seen == {"in_transaction": False, "type": dict}
    assert job(db, "a")["status"] == "done"


def test_a_send_that_mutates_its_argument_cannot_move_the_mark(con, db):
    put(con, "a")
    put(con, "b")

    def mutate(event):
        event["id"] = "b"
        event["qty"] = 999

    assert w.run_once(con, "w1", Clock(T0, T0 + 1), Sender(True, mutate), 1)["id"] == "a"
    assert (job(db, "a")["status"], job(db, "b")["status"]) == ("done", "pending")


def test_a_send_that_enqueues_elsewhere_does_not_confuse_finish(con, db):
    put(con, "a")

    def enqueue_more(event):
        other = w.open_queue(db)
        try:
            w.enqueue(other, {"id": "new", "qty": 1}, T0, 1000)
        finally:
            other.close()

    assert w.run_once(con, "w1", Clock(T0, T0 + 1), Sender(True, enqueue_more), 1) == {
        "id": "a",
        "token": 1,
        "status": "done",
    }
    assert job(db, "new")["status"] == "pending"


@pytest.mark.parametrize("ack", [False, 1, "True", None, {"ok": True}, 1.0])
def test_anything_but_exact_true_is_a_bad_ack_and_the_lease_stays(con, db, ack):
    put(con)
    clock = Clock(T0, T0 + 1)
    with pytest.raises(w.BadAck):
        w.run_once(con, "w1", clock, Sender(ack), 1)
    assert job(db, "a")["status"] == "leased" and clock.calls == 1


class Flaky(w.Retryable):
    pass


@pytest.mark.parametrize(
    ("jitter", "error"),
    [(1, w.Retryable("503")), (0.5, Flaky("reset")), (0, w.Retryable()), (0.29, w.Retryable())],
)
def test_retryable_retries_with_capped_jittered_delay(con, db, jitter, error):
    put(con)
    result = w.run_once(con, "w1", Clock(T0, T0 + 20), Sender(error), jitter)
    assert result == {"id": "a", "token": 1, "status": "pending"}
    row = job(db, "a")
    assert (row["reason"], row["available_at"]) == (
        "retry",
        T0 + 20 + w.retry_delay(1, 100, 1000, jitter),
    )


def test_retry_delay_grows_with_the_attempt(con, db):
    put(con, max_attempts=5)
    now = T0
    for attempt in range(1, 5):
        clock = Clock(now, now + 1)
        assert w.run_once(con, "w1", clock, Sender(w.Retryable()), 1)["status"] == "pending"
        delay = job(db, "a")["available_at"] - (now + 1)
        assert delay == min(1000, 100 * 2 ** (attempt - 1))
        now = job(db, "a")["available_at"]


def test_retryable_on_the_last_attempt_is_exhausted(con, db):
    put(con, max_attempts=1)
    assert w.run_once(con, "w1", Clock(T0, T0 + 1), Sender(w.Retryable()), 1)["status"] == "dead"
    assert job(db, "a")["reason"] == "exhausted"


def test_permanent_is_dead_permanent(con, db):
    put(con)
    result = w.run_once(con, "w1", Clock(T0, T0 + 1), Sender(w.Permanent("400")), 1)
    assert result == {"id": "a", "token": 1, "status": "dead"}
    assert job(db, "a")["reason"] == "permanent"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("boom"),
        TimeoutError("slow"),
        w.BadAck("wrong id"),
        w.Conflict("?"),
        KeyboardInterrupt(),
    ],
)
def test_unclassified_errors_propagate_unchanged_and_the_lease_stays(con, db, error):
    put(con)
    clock = Clock(T0, T0 + 1)
    with pytest.raises(type(error)) as raised:
        w.run_once(con, "w1", clock, Sender(error), 1)
    assert raised.value is error
    assert job(db, "a")["status"] == "leased" and clock.calls == 1


@pytest.mark.parametrize("second", [T0 - 1, True, float(T0 + 1), None, -1, w.MAX_NOW + 1])
def test_a_bad_second_reading_raises_and_keeps_the_committed_claim(con, db, second):
    put(con)
    with pytest.raises(ValueError):
        w.run_once(con, "w1", Clock(T0, second), Sender(True), 1)
    assert (job(db, "a")["status"], job(db, "a")["token"]) == ("leased", 1)


def test_an_equal_second_reading_is_fine(con):
    put(con)
    assert w.run_once(con, "w1", Clock(T0, T0), Sender(True), 1)["status"] == "done"


@pytest.mark.parametrize("first", [-1, True, 1.5, "now", w.MAX_NOW + 1])
def test_a_bad_first_reading_claims_nothing(con, db, first):
    put(con)
    send = Sender()
    with pytest.raises(ValueError):
        w.run_once(con, "w1", Clock(first), send, 1)
    assert job(db, "a")["status"] == "pending" and send.calls == []


def test_stale_when_the_lease_ran_out_during_the_send(con, db):
    put(con)
    result = w.run_once(con, "w1", Clock(T0, T0 + 100), Sender(True), 1, lease_ms=100)
    assert result == {"id": "a", "token": 1, "status": "stale"}
    assert job(db, "a")["status"] == "leased"  # a late result never touches the job


def test_stale_when_another_worker_took_over(con, db):
    put(con)

    def takeover(event):
        other = w.open_queue(db)
        try:
            assert w.claim(other, "w2", T0 + 100)["token"] == 2
        finally:
            other.close()

    result = w.run_once(con, "w1", Clock(T0, T0 + 50), Sender(True, takeover), 1, lease_ms=100)
    assert result == {"id": "a", "token": 1, "status": "stale"}
    assert (job(db, "a")["owner"], job(db, "a")["token"]) == ("w2", 2)


@pytest.mark.parametrize("jitter", [True, -0.5, 1.01, float("nan"), "0.5", None, 10**400])
def test_jitter_is_validated_before_the_clock(con, db, jitter):
    put(con)
    clock = Clock(T0)
    with pytest.raises(ValueError):
        w.run_once(con, "w1", clock, Sender(), jitter)
    assert clock.calls == 0


@pytest.mark.parametrize(
    ("owner", "clock", "send", "lease"),
    [
        ("bad owner", Clock(T0), Sender(), 1000),
        ("w1", None, Sender(), 1000),
        ("w1", Clock(T0), "send", 1000),
        ("w1", Clock(T0), Sender(), 0),
        ("w1", Clock(T0), Sender(), 60_001),
        ("w1", Clock(T0), Sender(), False),
    ],
)
def test_run_once_rejects_bad_arguments_before_reading_the_clock(
    con, db, owner, clock, send, lease
):
    put(con)
    with pytest.raises(ValueError):
        w.run_once(con, owner, clock, send, 0.5, lease)
    assert job(db, "a")["status"] == "pending"
    assert clock is None or clock.calls == 0


# --- run_file ------------------------------------------------------------------------------


def test_run_file_refuses_a_missing_file_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        w.run_file(tmp_path / "missing.db", "w1", Clock(T0), Sender(), 1)
    assert list(tmp_path.iterdir()) == []


def test_run_file_refuses_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        w.run_file(str(tmp_path), "w1", Clock(T0), Sender(), 1)


def test_run_file_validates_before_touching_the_file(tmp_path):
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(ValueError):
        w.run_file(str(empty), "w1", Clock(T0), Sender(), 2)
    assert empty.stat().st_size == 0


@pytest.fixture
def opened(monkeypatch):
    connections: list[sqlite3.Connection] = []
    real = w.open_queue

    def tracked(path):
        connections.append(real(path))
        return connections[-1]

    monkeypatch.setattr(w, "open_queue", tracked)
    return connections


def test_run_file_owns_and_closes_its_connection(con, db, opened):
    put(con, qty=2)
    assert w.run_file(db, "w1", Clock(T0, T0 + 1), Sender(True), 1) == {
        "id": "a",
        "token": 1,
        "status": "done",
    }
    assert w.run_file(str(db), "w1", Clock(T0 + 2), Sender(True), 1) is None
    assert len(opened) == 2
    for connection in opened:
        with pytest.raises(sqlite3.ProgrammingError):
            connection.execute("SELECT 1")


def test_run_file_closes_its_connection_on_error(con, db, opened):
    put(con)
    with pytest.raises(RuntimeError, match="down"):
        w.run_file(db, "w1", Clock(T0), Sender(RuntimeError("down")), 1)
    with pytest.raises(sqlite3.ProgrammingError):
        opened[0].execute("SELECT 1")
    assert job(db, "a")["status"] == "leased"
