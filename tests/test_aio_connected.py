"""A cancel never leaves an aiosqlite connect or close running past its event loop.

aiosqlite answers from its connection's thread through the loop; a connect cut by a cancel
goes on in that thread, and its answer to a loop closed meanwhile is a traceback on stderr
(a dashboard stopped by SIGTERM while it sampled wrote one).  ``sqlite_aio.connected``
waits for the connect to end and closes the connection before the cancel goes on; a connect
that fails returns once its connection's thread has ended (``sqlite_aio.opened``).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

import aiosqlite
import aiosqlite.core
import pytest

from asnackq.store.sqlite_aio import connected, opened


def cancelled_while_connecting(path: str, opener: Any) -> tuple[list[Any], list[Any]]:
    """Open ``path`` with ``opener``, cancel while sqlite3 connects, wait for the cancelled
    task and close the loop, let the connect end; returns the connections made and the
    threads' uncaught exceptions."""
    gate, entered = threading.Event(), threading.Event()
    made: list[Any] = []

    class Slow(sqlite3.Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            entered.set()
            gate.wait(30)
            super().__init__(*args, **kwargs)
            made.append(self)

    async def use() -> None:
        async with opener(path, factory=Slow) as con:
            await con.execute("SELECT 1")

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(use())
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()  # (then waited for, as a command's cleanup waits for its tasks)
        # A task that ends while the connect is held ends before it (the gate opens after
        # this loop has closed, whatever the machine's load); one still running waits for it.
        if not (await asyncio.wait({task}, timeout=0.5))[0]:
            gate.set()
        await asyncio.gather(task, return_exceptions=True)
        return task

    raised: list[Any] = []
    hook, threading.excepthook = threading.excepthook, raised.append
    before = set(threading.enumerate())
    try:
        task = asyncio.run(main())
        gate.set()
        for thread in set(threading.enumerate()) - before:  # (the connection's thread)
            thread.join(30)
    finally:
        threading.excepthook = hook
    assert task.cancelled()
    return made, raised


def test_a_cancel_while_connecting_waits_for_the_connect_and_closes_it(tmp_path):
    made, raised = cancelled_while_connecting(str(tmp_path / "q.db"), connected)
    assert raised == []
    assert len(made) == 1
    with pytest.raises(sqlite3.ProgrammingError):  # (closed)
        made[0].execute("SELECT 1")


def test_aiosqlite_alone_answers_a_closed_loop_so(tmp_path):
    """The failure ``connected`` prevents, shown on aiosqlite itself."""
    _, raised = cancelled_while_connecting(str(tmp_path / "q.db"), aiosqlite.connect)
    assert raised and all(isinstance(r.exc_value, RuntimeError) for r in raised)
    assert "Event loop is closed" in str(raised[0].exc_value)


def cancelled_caller(path: str, connect_fails: bool, inside: bool) -> tuple[bool, bool]:
    """A caller catching ``sqlite3.Error`` around ``connected``, cancelled while sqlite3
    connects (or, ``inside``, within the block): whether it ended cancelled, and whether it
    went on past the block."""
    gate, entered = threading.Event(), threading.Event()

    class Gated(sqlite3.Connection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            entered.set()
            gate.wait(30)
            if connect_fails:
                raise sqlite3.OperationalError("unable to open database file")
            super().__init__(*args, **kwargs)

    went_on = []
    within = asyncio.Event()

    async def use() -> None:
        try:
            async with connected(path, factory=Gated):
                within.set()
                await asyncio.sleep(30)
        except sqlite3.Error:
            pass
        went_on.append(True)

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(use())
        assert await asyncio.to_thread(entered.wait, 30)
        if inside:
            gate.set()
            await asyncio.wait_for(within.wait(), 30)
        task.cancel()
        gate.set()
        await asyncio.gather(task, return_exceptions=True)
        return task

    return asyncio.run(main()).cancelled(), bool(went_on)


def test_a_cancelled_caller_whose_connect_fails_is_cancelled_not_handed_the_failure(tmp_path):
    """A caller that catches ``sqlite3.Error`` (as the open's schema check does) must not
    go on after its cancel because the connect then failed."""
    assert cancelled_caller(str(tmp_path / "q.db"), True, False) == (True, False)


@pytest.mark.parametrize("inside", [False, True])
def test_a_cancelled_caller_whose_close_then_fails_is_cancelled(tmp_path, monkeypatch, inside):
    """A cancel that lands while connecting or inside the block, then a close that fails:
    the caller is cancelled (a caller catching ``sqlite3.Error`` would go on otherwise)."""
    close = aiosqlite.Connection.close

    async def failing_close(self: aiosqlite.Connection) -> None:
        await close(self)
        raise sqlite3.OperationalError("close failed")

    monkeypatch.setattr(aiosqlite.Connection, "close", failing_close)
    assert cancelled_caller(str(tmp_path / "q.db"), False, inside) == (True, False)


@pytest.mark.parametrize("how", ["connected", "opened"])
def test_a_failed_connect_returns_once_its_connections_thread_has_ended(tmp_path, monkeypatch, how):
    """aiosqlite's failed connect queues a stop for its connection's thread whose answer
    nobody awaits: ``connected`` and ``opened`` return once that thread has ended, so the
    answer never meets a loop that the failure has closed (a traceback on stderr), however
    late the thread runs it."""
    worker = aiosqlite.core._connection_worker_thread

    def late(tx: Any) -> None:  # (the thread's stop runs 0.3 s late, as on a busy machine)
        class Late:
            def get(self) -> Any:
                future, function = tx.get()
                if getattr(function, "__name__", "") == "close_and_stop":
                    time.sleep(0.3)
                return future, function

        worker(Late())

    monkeypatch.setattr(aiosqlite.core, "_connection_worker_thread", late)
    missing = str(tmp_path / "no such directory" / "q.db")

    async def main() -> None:
        if how == "opened":
            await opened(missing)
        async with connected(missing):
            pass

    raised: list[Any] = []
    hook, threading.excepthook = threading.excepthook, raised.append
    before = set(threading.enumerate())
    try:
        with pytest.raises(sqlite3.OperationalError):
            asyncio.run(main())
        running = [thread for thread in set(threading.enumerate()) - before if thread.is_alive()]
        for thread in running:
            thread.join(30)
    finally:
        threading.excepthook = hook
    assert running == [] and raised == []
