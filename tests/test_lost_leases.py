"""A lease that ends without a result (its worker died, or lost its database) is not a
refusal: the product's claims (``Limits.max_losses``) take the job again at the same attempt,
and a separate bound ends a job whose leases end so again and again ('poison').  The
contract's claims keep the contract's rule.  Every driver, on real files and databases; and
a lab whose workers are SIGKILLed every 0.3 s ends no job dead."""

from __future__ import annotations

import json
import random
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from asnackq.core import worker as w
from asnackq.lab import procs
from asnackq.store import pg

from .conftest import T0, job
from .drivers import DRIVERS, AioBridge, PgCon, connect, on_pg, q

LEASE = 500  # (MAX_LOSSES leases fit in the 60 s ttl the contract allows)
LOSSES = w.PRODUCT.max_losses


@pytest.fixture(
    params=[pytest.param(d, marks=pytest.mark.process) if on_pg(d) else d for d in DRIVERS]
)
def driver(request):
    return request.param


@pytest.fixture
def db(driver, tmp_path, request):
    return request.getfixturevalue("pg_db")() if on_pg(driver) else tmp_path / "queue.db"


@pytest.fixture
def con(driver, db):
    yield from connect(driver, db)


def product(con: Any, name: str, *args: Any) -> Any:
    """The core's ``plan_NAME(*args)`` with the product's limits, through ``con``'s driver."""
    make = partial(getattr(w, f"plan_{name}"), *args, limits=w.PRODUCT)
    if isinstance(con, AioBridge):
        con.queue.limits = w.PRODUCT
        try:
            return con.wait(getattr(con.queue, name)(*args))
        finally:
            con.queue.limits = w.CONTRACT
    if isinstance(con, PgCon):
        return pg.drive(con.con, make(), None, make=make)
    return w.drive(con, make())


def claim(con: Any, now: int, owner: str = "w") -> w.Ticket | None:
    return product(con, "claim", owner, now, LEASE)


def test_a_lost_lease_is_taken_again_at_the_same_attempt(con, db):
    """Each loss: a new token at the same attempt, the old holder fenced out; only the
    receiver's refusals spend the budget, so a job lost at its last attempt is sent again."""
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 60_000, 2)
    first = claim(con, T0)
    assert (first["attempt"], first["token"]) == (1, 1)
    again = claim(con, T0 + LEASE)  # the first holder died: its lease ended
    assert (again["attempt"], again["token"]) == (1, 2)
    assert q.finish(con, first, "ok", T0 + LEASE + 1) is False  # fenced out
    assert q.finish(con, again, "retry", T0 + LEASE + 2) == "pending"
    last = claim(con, T0 + LEASE + 2)
    assert (last["attempt"], last["token"]) == (2, 3)
    for n in range(1, 4):  # lost at its last attempt, again and again: never exhausted
        lost = claim(con, T0 + (n + 1) * LEASE + 2)
        assert (lost["attempt"], lost["token"]) == (2, 3 + n)
        assert job(db, "a")["attempts"] == 2
    assert q.finish(con, lost, "retry", T0 + 5 * LEASE) == "dead"
    assert (job(db, "a")["status"], job(db, "a")["reason"]) == ("dead", "exhausted")


def test_the_contracts_claims_keep_the_contracts_rule(con, db):
    """With ``CONTRACT`` a reclaim is an attempt: lost at the last one, the job is dead."""
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 60_000, 2)
    assert q.claim(con, "w", T0, LEASE)["attempt"] == 1
    assert q.claim(con, "w", T0 + LEASE, LEASE)["attempt"] == 2
    assert q.claim(con, "w", T0 + 2 * LEASE, LEASE) is None
    assert (job(db, "a")["status"], job(db, "a")["reason"]) == ("dead", "exhausted")


def test_the_max_losses_th_lost_lease_ends_the_job_as_poison(con, db):
    """A job whose leases end with no result ``max_losses`` times is dead 'poison' (counted
    in the cycle's ended jobs), whatever its attempts left; other jobs are claimed on."""
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 60_000, 16)
    now = T0
    for loss in range(LOSSES):
        ticket = claim(con, now)
        assert (ticket["id"], ticket["attempt"], ticket["token"]) == ("a", 1, loss + 1)
        now += LEASE
    q.enqueue(con, {"id": "b", "qty": 1}, now, 60_000, 16)
    _, _, tickets, ended = product(con, "cycle", [], [], "w", now, LEASE, 2)
    assert [t["id"] for t in tickets] == ["b"] and ended == {"poison": 1}
    row = job(db, "a")
    assert (row["status"], row["reason"], row["attempts"], row["owner"]) == (
        "dead",
        "poison",
        1,
        None,
    )


def test_a_redrive_counts_the_losses_again_from_zero(con, db):
    """After a redrive a job has ``max_losses`` losses again before it is poison."""
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 60_000, 3)
    now = T0
    for _ in range(LOSSES):
        claim(con, now)
        now += LEASE
    assert claim(con, now) is None and job(db, "a")["reason"] == "poison"
    assert q.redrive(con, "a", now, 60_000, "receiver-fixed") is True
    for loss in range(LOSSES - 1):
        ticket = claim(con, now)
        assert (ticket["attempt"], job(db, "a")["attempts"]) == (1, 1), loss
        now += LEASE
    last = claim(con, now)
    assert last is not None and q.finish(con, last, "ok", now + 1) == "done"


def test_a_lost_job_past_its_deadline_ends_by_deadline(con, db):
    q.enqueue(con, {"id": "a", "qty": 1}, T0, 2 * LEASE + 500, 5)
    claim(con, T0)
    assert claim(con, T0 + LEASE)["attempt"] == 1
    assert claim(con, T0 + 3 * LEASE) is None
    assert job(db, "a")["reason"] == "deadline"


@pytest.mark.process
@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
@pytest.mark.parametrize("where", ["file", "pg"])
def test_a_lab_killing_a_worker_every_300_ms_ends_no_job_dead(tmp_path, request, where):
    """Workers SIGKILLed every 0.3 s, five attempts a job, a sink that never refuses: every
    job done, none dead, no violation (a crash is not a refusal)."""
    db = ["--db", request.getfixturevalue("pg_db")()] if where == "pg" else []
    argv = ["lab", "--jobs", 3000, "--processes", 3, "--kill-every", 0.3, "--max-attempts", 5]
    argv += [*db, "--dir", tmp_path / "lab", "--json", tmp_path / "lab.json"]
    done = subprocess.run(procs.command(*argv), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    result = json.loads(Path(tmp_path / "lab.json").read_text())
    assert result["kills"] >= 3, result["kills"]
    assert result["statuses"] == {"done": 3000} and result["violations"] == []
    assert result["liveness_failures"] == []


@pytest.mark.process
def test_a_lab_kills_only_a_worker_that_has_delivered_since_it_started(tmp_path):
    """The victim has a committed result in its trace; a worker still starting or on its
    first round trip (claims only, a fenced finish, a line the kill cut) is spared, so kills
    faster than a start on a slow machine cannot stop all progress."""
    workers = procs.Workers(tmp_path, tmp_path / "q.db", ["http://127.0.0.1:9/events"], [])
    claim = {"e": "claim", "id": "a", "token": 1, "owner": "x", "at": T0}
    lines = {
        "starting": [],
        "claimed": [claim],
        "fenced": [claim, {**claim, "e": "finish", "status": False}],
    }
    for owner, records in lines.items():
        text = "".join(json.dumps(r) + "\n" for r in records)
        (tmp_path / f"{owner}.trace").write_text(text)
        workers.procs[owner] = procs.start(["sleep", "60"])
    (tmp_path / "cut.trace").write_text(json.dumps({**claim, "e": "finish", "status": "done"})[:30])
    workers.procs["cut"] = procs.start(["sleep", "60"])
    try:
        assert not workers.kill_one(random.Random(1))
        assert workers.kills == 0 and all(p.poll() is None for p in workers.procs.values())
        with open(tmp_path / "cut.trace", "w") as trace:  # the line completed: a delivery
            trace.write(json.dumps({**claim, "e": "finish", "status": "done"}) + "\n")
        assert not workers.kill_one(random.Random(1), served_s=3600)  # not served that long
        assert workers.kill_one(random.Random(1))
        assert workers.kills == 1 and workers.procs["cut"].poll() == -9
        assert [p.poll() for o, p in workers.procs.items() if o in lines] == [None] * 3
        assert len(workers.procs) == 5  # its replacement started
    finally:
        workers.stop()
