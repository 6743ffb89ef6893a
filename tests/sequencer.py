"""Orderings for tests, by the program instead of the wall clock.

* ``Sequencer`` (after trio's ``trio.testing.Sequencer``) makes coroutines take turns:
  ``async with seq(n):`` waits until the blocks of positions 0 .. n-1 have run, whatever
  order the coroutines arrive in.  A coroutine cancelled while waiting breaks the sequencer:
  every waiting and later turn raises, so a test fails instead of hanging.
* ``LoopClock`` (after trio's ``MockClock``) is the running event loop's clock, moved by the
  test: ``advance(s)`` makes ``s`` seconds pass at once for every timer, ``asyncio.sleep``,
  ``asyncio.timeout`` and anything the code under test measures with ``loop.time()``.  The
  real clock runs beneath, so sockets and threads keep their own pace; a test asserts what
  the code did in the loop's time, which a busy machine only lengthens.
* ``until`` waits for a condition the test names, bounded far above what it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

__all__ = ["LoopClock", "Sequencer", "until"]


class Sequencer:
    """Blocks that run in the order of their positions (0, 1, 2, ...), each position once."""

    def __init__(self) -> None:
        self._ended: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self._taken: set[int] = set()
        self._broken = False

    @contextlib.asynccontextmanager
    async def __call__(self, position: int) -> AsyncIterator[None]:
        if position in self._taken:
            raise RuntimeError(f"position {position} is taken already")
        self._taken.add(position)
        if position > 0:
            try:
                await self._ended[position - 1].wait()
            except asyncio.CancelledError:
                self._break()
                raise
        if self._broken:
            raise RuntimeError(
                "the sequencer is broken: a coroutine waiting its turn was cancelled"
            )
        try:
            yield
        finally:
            self._ended[position].set()

    def _break(self) -> None:
        self._broken = True
        for ended in list(self._ended.values()):
            ended.set()


class LoopClock:
    """A loop's clock plus an offset the test moves forward (see the module's rules)."""

    def __init__(self, real: Callable[[], float]) -> None:
        self._real = real
        self.offset = 0.0

    def time(self) -> float:
        """The loop's time: the real monotonic reading plus every advance so far."""
        return self._real() + self.offset

    def advance(self, seconds: float) -> None:
        """Make ``seconds`` pass at once: timers due by then fire on the loop's next turn."""
        if not seconds >= 0:
            raise ValueError(f"a clock moves forward only, not by {seconds}")
        self.offset += seconds


async def until(condition: Callable[[], object], within_s: float = 60.0) -> None:
    """Return once ``condition()`` holds (looked at every 10 ms); fail after ``within_s``."""
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110  (a condition of the code under test: polled)
            await asyncio.sleep(0.01)
