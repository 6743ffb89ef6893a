"""One transaction or intake at a time on an application's connection, whichever part of
asnackq runs it.

Two queues (or a queue, the outbox and a webhook receiver) on one connection would
otherwise interleave their statements; ``turn(con)`` is the lock they all take, one per
connection, gone with it.  Code running on behalf of the holder may take it again: the
holding task and the tasks it starts while it holds the turn (an intake inside a webhook
receiver's effect runs in a task of its own, in the receiver's transaction).  Any other
task waits.  A task that outlives the hold it was started under holds nothing.
"""

from __future__ import annotations

import asyncio
import contextvars
import weakref
from types import TracebackType

__all__ = ["Turn", "turn"]

# The holds the running code is inside: a task started under a hold inherits it.
_HELD: contextvars.ContextVar[frozenset[object]] = contextvars.ContextVar(
    "asnackq_turns_held", default=frozenset()
)


class Turn:
    """An asyncio lock that the code holding it may take again (each take released once)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._hold: object | None = None  # this hold's mark, while the turn is held
        self._depth = 0

    async def __aenter__(self) -> None:
        if self._hold is not None and self._hold in _HELD.get():
            self._depth += 1
            return
        await self._lock.acquire()
        self._hold, self._depth = object(), 1
        _HELD.set(_HELD.get() | {self._hold})

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth == 0:
            _HELD.set(_HELD.get() - {self._hold})
            self._hold = None
            self._lock.release()

    def locked(self) -> bool:
        """Whether some code holds the turn."""
        return self._lock.locked()


_turns: weakref.WeakKeyDictionary[object, Turn] = weakref.WeakKeyDictionary()


def turn(con: object) -> Turn:
    """The turn every transaction and intake asnackq runs on the application's connection
    ``con`` takes (and the application's own transactions on it, when they share it)."""
    found = _turns.get(con)
    if found is None:
        found = _turns[con] = Turn()
    return found
