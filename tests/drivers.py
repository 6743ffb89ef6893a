"""Both drivers behind one face, so one suite of scenarios runs against each.

``con`` is a ``sqlite3.Connection`` (the sync core) or an ``AioBridge`` (an ``AsyncQueue``
on an event loop in a background thread); ``q.NAME(con, ...)`` calls the same operation
on either, with the core's signature.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w


class AioBridge:
    """An AsyncQueue driven from synchronous test code."""

    def __init__(self, path: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.queue: AsyncQueue = self.wait(AsyncQueue.connect(path, limits=w.CONTRACT))

    def wait(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    @property
    def in_transaction(self) -> bool:
        return self.queue.in_transaction

    def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        self.wait(self.queue.set_trace_callback(callback))

    def close(self) -> None:
        self.wait(self.queue.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class Operations:
    """``q.claim(con, ...)`` and friends, dispatched on the kind of ``con``."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(con: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(con, AioBridge):
                return con.wait(getattr(con.queue, name)(*args, **kwargs))
            return getattr(w, name)(con, *args, **kwargs)
        return call


q = Operations()


def connect(driver: str, db: Path) -> Iterator[sqlite3.Connection | AioBridge]:
    """Yield a connection of the given driver; afterwards insist no transaction is open."""
    con: Any = w.open_queue(db) if driver == "sync" else AioBridge(db)
    try:
        yield con
        assert not con.in_transaction, "a function left a transaction open"
    finally:
        con.close()
