"""A throwaway PostgreSQL server for the tests, fresh databases, and reads of their rows.

The server starts once per session (``asnackq.lab.pg_server``, durability off for speed); each
test that asks gets its own database, dropped afterwards.  Without PostgreSQL binaries the
tests that need it skip with one line; with ``ASNACKQ_REQUIRE_PG=1`` (CI) that is an error.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from asnackq.lab.pg_server import FAST, SUPERUSER, LocalServer, create, find_binaries
from asnackq.store.pg_session import SCOUT_NAME

REQUIRED = os.environ.get("ASNACKQ_REQUIRE_PG") == "1"
_names = itertools.count(1)


def start_server(settings: dict[str, str] = FAST) -> Iterator[Pool]:
    """The session's server and its databases, or a skip (an error with ASNACKQ_REQUIRE_PG=1)."""
    binaries = find_binaries()
    if binaries is None:
        why = "PostgreSQL binaries (initdb, pg_ctl) not found"
        if REQUIRED:
            pytest.fail(f"ASNACKQ_REQUIRE_PG=1 but {why}", pytrace=False)
        pytest.skip(why)
    try:
        server = create(binaries, settings)
    except RuntimeError as error:
        if REQUIRED:
            raise
        pytest.skip(f"PostgreSQL did not start: {error}")
    pool = Pool(server)
    try:
        yield pool
    finally:
        pool.close()
        server.stop()


class Pool:
    """Databases of the session's server, each handed to one test at a time.

    A returned database is emptied (its other sessions ended, its public schema dropped
    and made again): much faster than CREATE DATABASE, which checkpoints.
    """

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.free: list[str] = []
        self.admin = psycopg.connect(server.url(), autocommit=True)

    def take(self) -> str:
        if self.free:
            return self.free.pop()
        name = f"t{os.getpid()}_{next(_names)}"
        self.admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        return name

    def give_back(self, name: str) -> None:
        self.admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        self.admin.execute(f"ALTER DATABASE {name} OWNER TO {SUPERUSER}")
        with psycopg.connect(self.server.url(name), autocommit=True) as con:
            con.execute("DROP SCHEMA public CASCADE")
            con.execute("CREATE SCHEMA public AUTHORIZATION pg_database_owner")
        self.free.append(name)

    def close(self) -> None:
        self.admin.close()


def databases(pool: Pool) -> Iterator[Callable[[], str]]:
    """A factory of empty databases (their URLs) for one test; all given back after it."""
    taken: list[str] = []

    def new() -> str:
        taken.append(pool.take())
        return pool.server.url(taken[-1])

    try:
        yield new
    finally:
        for name in taken:
            pool.give_back(name)


def one_at_a_time(pool: Pool) -> Iterator[Callable[[], str]]:
    """A factory of empty databases where each call gives the previous one back first (for
    hypothesis examples, which run one after the other)."""
    taken: list[str] = []

    def fresh() -> str:
        if taken:
            pool.give_back(taken.pop())
        taken.append(pool.take())
        return pool.server.url(taken[-1])

    try:
        yield fresh
    finally:
        for name in taken:
            pool.give_back(name)


def login(pool: Pool, name: str, password: str, url: str) -> str:
    """A TCP URL with a password for a role that owns ``url``'s database."""
    admin, database = pool.admin, conninfo_to_dict(url)["dbname"]
    if not admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchall():
        admin.execute(f"CREATE ROLE {name} LOGIN")
    admin.execute(f"ALTER ROLE {name} PASSWORD '{password}'")
    admin.execute(f"ALTER DATABASE {database} OWNER TO {name}")
    return pool.server.tcp_url(name, password, database)


def query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of one query through a separate session."""
    with psycopg.connect(url, autocommit=True) as con:
        cursor = con.execute(sql, params)
        return [tuple(row) for row in cursor] if cursor.description is not None else []


def dict_row(url: str, sql: str, params: tuple[Any, ...]) -> dict[str, Any] | None:
    with psycopg.connect(url, autocommit=True) as con:
        cursor = con.execute(sql, params)
        row = cursor.fetchone()
        if row is None:
            return None
        assert cursor.description is not None
        return {column.name: value for column, value in zip(cursor.description, row, strict=True)}


class Read(NamedTuple):
    """A read of a table in a plan as it ran (``EXPLAIN ANALYZE``)."""

    kind: str  # its node: "Index Scan", "Seq Scan", ...
    relation: str
    visited: int  # rows it returned and removed by its filter, every loop counted
    counted: bool  # under an aggregate (a count's read)


def done_statistics(
    con: psycopg.Connection[Any], deadline: int, lease_until: int, pending: bool = False
) -> None:
    """``jobs`` as statistics taken over done jobs see it (a held snapshot's table of done
    versions): 100,000 jobs analyzed while done (``pending``: the last 10,000 pending, every
    one attempted), then seqs 95,701-96,000 leased (until ``lease_until``) and
    96,001-100,000 pending, all with ``deadline``."""
    con.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")  # (the statistics stay)
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline) SELECT 'j' || i, 1, CASE WHEN %s AND i > 90000 THEN 'pending' ELSE 'done'"
        " END, 1, 3, 1, 0, %s FROM generate_series(1, 100000) AS i",
        (pending, deadline),
    )
    con.execute("ANALYZE jobs")
    con.execute(
        "UPDATE jobs SET status = 'leased', lease_until = %s WHERE seq > 95700", (lease_until,)
    )
    con.execute("UPDATE jobs SET status = 'pending', lease_until = NULL WHERE seq > 96000")


def executed_plan(
    con: psycopg.Connection[Any], sql: str, params: Any, *, client: bool = False
) -> dict[str, Any]:
    """The plan of ``sql`` as it ran (EXPLAIN (ANALYZE, FORMAT JSON)) on ``con`` (autocommit),
    in a transaction rolled back: nothing it wrote or locked stays.  ``client``: parameters
    bound client-side (``? IS NULL`` works, as on SQLite)."""
    cursor = psycopg.ClientCursor(con) if client else con.cursor()
    con.execute("BEGIN")
    try:
        [(plan,)] = cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchall()
    finally:
        con.execute("ROLLBACK")
    return plan[0]["Plan"]  # type: ignore[no-any-return]


def reads(node: dict[str, Any], counted: bool = False) -> list[Read]:
    """Each read of a table in an executed plan (``executed_plan``), in plan order."""
    found = []
    if "Relation Name" in node:
        visited = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        found.append(
            Read(node["Node Type"], node["Relation Name"], visited * node["Actual Loops"], counted)
        )
    for child in node.get("Plans", ()):
        found += reads(child, counted or node["Node Type"] == "Aggregate")
    return found


def statements(query: str) -> list[str]:
    """A query's statements as a server runs them: PostgreSQL's async driver sends BEGIN
    with a transaction's first statement, as one query (``pg.begun``)."""
    if query.startswith("BEGIN; "):
        return ["BEGIN", query.removeprefix("BEGIN; ")]
    return [query]


def tracing(callback: Callable[[str], object]) -> tuple[type, type]:
    """Cursor classes (sync, async) that show each statement to ``callback`` first."""

    class Traced(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            callback(str(query))
            return super().execute(query, *args, **kwargs)

        def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            callback(str(query))
            return super().executemany(query, *args, **kwargs)

    class AsyncTraced(psycopg.AsyncCursor[Any]):
        async def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            callback(str(query))
            return await super().execute(query, *args, **kwargs)

        async def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            callback(str(query))
            return await super().executemany(query, *args, **kwargs)

    return Traced, AsyncTraced


def sessions(url: str, scouts: bool = True) -> int:
    """Sessions other than this one connected to ``url``'s database (``scouts`` False: not
    counting a queue's scouts' session, which a slow walk from the front opens: ``pg_walks``)."""
    with psycopg.connect(url) as con:
        row = con.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND (%s OR application_name <> %s)",
            (scouts, SCOUT_NAME),
        ).fetchone()
    return int(row[0]) if row else 0


async def ended(url: str) -> bool:
    """Whether every session on ``url`` ends within 30 s (a backend exits just after its
    client closes, and leaves ``pg_stat_activity`` a moment later on a busy machine)."""
    for _ in range(300):
        if sessions(url) == 0:
            return True
        await asyncio.sleep(0.1)
    return False
