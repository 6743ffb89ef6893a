"""Shared fixtures: real queue files (or PostgreSQL databases), fake clocks, fault hooks."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asnackq.core import worker as w
from asnackq.lab.pg_server import LocalServer
from asnackq.store.outage import StoreUnavailable
from asnackq.store.targets import is_url

from . import pgdb
from .sequencer import LoopClock

T0 = 1_700_000_000_000


class Clock:
    """A fake clock returning the given readings in order (the last one repeats)."""

    def __init__(self, *readings: Any) -> None:
        self.readings = list(readings)
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.readings[min(self.calls, len(self.readings)) - 1]


class Hooks:
    """A fault callable that records every point, and raises at ``fail_at``."""

    def __init__(self, fail_at: str | None = None, action: Any = None) -> None:
        self.points: list[str] = []
        self.fail_at = fail_at
        self.action = action

    def __call__(self, point: str) -> None:
        self.points.append(point)
        if self.action is not None:
            self.action(point)
        if point == self.fail_at:
            raise RuntimeError(point)


def rows(path: Path | str) -> list[tuple[Any, ...]]:
    """Every job and audit row, read through a separate connection."""
    if is_url(path):
        return [
            *pgdb.query(path, "SELECT * FROM jobs ORDER BY seq"),
            ("--",),
            *pgdb.query(path, "SELECT * FROM redrives ORDER BY seq"),
        ]
    con = sqlite3.connect(path)
    try:
        jobs = con.execute("SELECT * FROM jobs ORDER BY seq").fetchall()
        audit = con.execute("SELECT * FROM redrives ORDER BY seq").fetchall()
        return [*jobs, ("--",), *audit]
    finally:
        con.close()


def job(path: Path | str, job_id: str) -> dict[str, Any] | None:
    """One job row as a dict, read through a separate connection."""
    if is_url(path):
        return pgdb.dict_row(path, "SELECT * FROM jobs WHERE id = %s", (job_id,))
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    try:
        row = con.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return dict(row) if row else None
    finally:
        con.close()


def execute(path: Path | str, sql: str) -> list[tuple[Any, ...]]:
    """One statement (committed) through a separate connection to a file or a database."""
    if is_url(path):
        return pgdb.query(path, sql)
    con = sqlite3.connect(path)
    try:
        found = con.execute(sql).fetchall()
        con.commit()
        return found
    finally:
        con.close()


async def asnackq_cli(*args: str, wait_s: float = 120) -> tuple[int, str, str]:
    """Run ``python -m asnackq ARGS`` as a child process: its exit code, stdout, stderr."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asnackq",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), wait_s)
    assert child.returncode is not None
    return child.returncode, out.decode(), err.decode()


@pytest.fixture
async def loop_clock(monkeypatch: pytest.MonkeyPatch) -> LoopClock:
    """The test's event loop reads its time from a ``LoopClock`` the test moves forward."""
    loop = asyncio.get_running_loop()
    clock = LoopClock(loop.time)
    monkeypatch.setattr(loop, "time", clock.time)
    return clock


@pytest.fixture(scope="session")
def pg_pool() -> Iterator[pgdb.Pool]:
    """One throwaway PostgreSQL server for the session (skips without the binaries)."""
    yield from pgdb.start_server()


@pytest.fixture
def pg_server(pg_pool: pgdb.Pool) -> LocalServer:
    return pg_pool.server


@pytest.fixture
def pg_db(pg_pool: pgdb.Pool) -> Iterator[Callable[[], str]]:
    """A factory of empty PostgreSQL databases (URLs), emptied again after the test."""
    yield from pgdb.databases(pg_pool)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


@pytest.fixture
def con(db: Path) -> Iterator[sqlite3.Connection]:
    connection = w.open_queue(db)
    yield connection
    assert not connection.in_transaction, "a function left a transaction open"
    connection.close()


@pytest.fixture
def statements(con: sqlite3.Connection) -> Iterator[list[str]]:
    """The transaction-control statements and first keywords that reach ``con``; the busy
    timeout the asyncio driver sets around its BEGIN (``sqlite_aio.poll_begin``: a setting
    of the connection, no statement of the transaction) is left out."""
    seen: list[str] = []

    def trace(sql: str) -> None:
        for one in pgdb.statements(sql):
            words = " ".join(one.split()[:2]).upper().rstrip(";")
            if words != "PRAGMA BUSY_TIMEOUT":
                seen.append(words)

    con.set_trace_callback(trace)
    yield seen
    con.set_trace_callback(None)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium (see tests/browser.py): skipped without one, failed in CI."""
    from .browser import chrome

    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


# Tests that start processes (a child asnackq, a PostgreSQL server, a browser, curl, ...) are
# marked ``process``: ``pytest -m "not process"`` is the quick loop.  A test that needs a
# throwaway PostgreSQL server or the browser is marked by its fixtures; any other test that
# starts a process without the mark fails, so the mark cannot drift.
PROCESS_FIXTURES = frozenset({"pg_pool", "pg_server", "pg_db", "browser"})


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test workers a core (most tests wait on sockets, processes and
    timers, not the CPU), at least two."""
    return max(2, 2 * len(os.sched_getaffinity(0)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("process") is not None:
        return

    def refuse(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it process")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def away_once(store: Any) -> None:
    """``store``'s next transaction is refused before its plan runs (the server away); the
    ones after it run."""
    run = store.run
    away = [True]

    async def once_away(make: w.Make, fault: w.Fault = None) -> Any:
        if away.pop() if away else False:
            raise StoreUnavailable("the server is away", retry_in_s=0.01)
        return await run(make, fault)

    store.run = once_away
