"""One transaction or intake at a time on an application's connection, whichever part of
asnackq runs it.

Two queues (or a queue, the outbox and a webhook receiver) on one connection would
otherwise interleave their statements; ``turn(con)`` is the lock they all take, one per
connection, gone with it.  The task holding a turn may take it again (an intake inside a
webhook receiver's effect: it runs in the receiver's transaction); any other task waits.
"""

from __future__ import annotations

import asyncio
import weakref
from types import TracebackType

__all__ = ["Turn", "turn"]


class Turn:
    """An asyncio lock that the task holding it may take again (each take released once)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._holder: asyncio.Task[object] | None = None
        self._depth = 0

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is not None and task is self._holder:
            self._depth += 1
            return
        await self._lock.acquire()
        self._holder, self._depth = task, 1

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
            self._lock.release()

    def locked(self) -> bool:
        """Whether some task holds the turn."""
        return self._lock.locked()


_turns: weakref.WeakKeyDictionary[object, Turn] = weakref.WeakKeyDictionary()


def turn(con: object) -> Turn:
    """The turn every transaction and intake asnackq runs on the application's connection
    ``con`` takes (and the application's own transactions on it, when they share it)."""
    found = _turns.get(con)
    if found is None:
        found = _turns[con] = Turn()
    return found
