"""One intake at a time on an application's connection, whichever queue or outbox runs it.

Two queues (or a queue and the outbox) on one connection would otherwise interleave their
savepoints; ``turn(con)`` is the lock they all take, one per connection, gone with it.
"""

from __future__ import annotations

import asyncio
import weakref

__all__ = ["turn"]

_turns: weakref.WeakKeyDictionary[object, asyncio.Lock] = weakref.WeakKeyDictionary()


def turn(con: object) -> asyncio.Lock:
    """The lock every intake on the application's connection ``con`` takes."""
    lock = _turns.get(con)
    if lock is None:
        lock = _turns[con] = asyncio.Lock()
    return lock
