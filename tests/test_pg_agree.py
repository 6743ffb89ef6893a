"""One random operation sequence through SQLite and PostgreSQL: the same results, the same rows."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asnackq.core import worker as w

from .conftest import T0, rows
from .drivers import PgCon, q
from .pgdb import one_at_a_time
from .test_aio import apply

# test_aio's operations on a denser timeline (most claims find work), and the batches:
# claim_many and a dispatcher's cycle.
NOW, TTL, LEASE, DELAY = (
    st.integers(0, 300),
    st.integers(100, 2000),
    st.integers(50, 300),
    st.integers(0, 100),
)
TICKET = st.integers(0, 7)
ENQUEUE = st.tuples(
    st.just("enqueue"),
    st.sampled_from("abcdef"),
    st.integers(1, 3),
    st.integers(0, 20),
    TTL,
    st.integers(1, 3),
)
OTHERS = st.one_of(
    ENQUEUE,
    st.tuples(st.just("claim"), st.sampled_from(["w1", "w2"]), NOW, LEASE),
    st.tuples(st.just("finish"), TICKET, st.sampled_from(w.OUTCOMES), NOW, DELAY),
    st.tuples(st.just("redrive"), st.sampled_from("abcdef"), NOW, TTL),
    st.tuples(st.just("extend"), TICKET, NOW, LEASE),
    st.tuples(st.just("claim_many"), st.sampled_from(["w1", "w2"]), NOW, LEASE, st.integers(1, 4)),
    st.tuples(
        st.just("cycle"),
        st.lists(st.tuples(TICKET, st.sampled_from(w.OUTCOMES), NOW, DELAY), max_size=3),
        st.lists(TICKET, max_size=3),
        NOW,
        LEASE,
        st.integers(0, 3),
    ),
)
BATCHES = st.tuples(
    st.lists(ENQUEUE, min_size=1, max_size=6), st.lists(OTHERS, min_size=1, max_size=30)
).map(lambda t: t[0] + t[1])


def call(con, name, *args):
    return getattr(q, name)(con, *args)


def batch(con, op, tickets):
    """A claim_many or a cycle on the tickets issued so far; new tickets are kept."""
    if op[0] not in ("claim_many", "cycle"):
        return "skipped"  # a finish or an extension before any ticket
    if op[0] == "claim_many":
        got = call(con, "claim_many", op[1], T0 + op[2], op[3], op[4])
        tickets.extend(got)
        return got
    _, finishes, held, now, lease, count = op
    if not tickets:
        return "skipped"
    results = [
        (tickets[i % len(tickets)], outcome, T0 + at, delay) for i, outcome, at, delay in finishes
    ]
    got = call(
        con,
        "cycle",
        results,
        [tickets[i % len(tickets)] for i in held],
        "w3",
        T0 + now,
        lease,
        count,
    )
    tickets.extend(got[2])
    return got


@pytest.fixture
def places(pg_pool):
    yield from one_at_a_time(pg_pool)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(operations=BATCHES)
def test_sqlite_and_postgresql_agree_on_random_operation_sequences(
    tmp_path_factory, places, operations
):
    path, url = tmp_path_factory.mktemp("agree") / "queue.db", places()
    sqlite, postgres = w.open_queue(path), PgCon(url)
    try:
        assert apply(sqlite, operations, call, batch) == apply(postgres, operations, call, batch)
    finally:
        sqlite.close()
        postgres.close()
    assert rows(path) == rows(url)
