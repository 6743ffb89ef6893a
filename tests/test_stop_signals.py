"""A stop signal asked for twice is two cancellations, even when both arrive together."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.cli.common import stop_signals

WAIT_S = 60  # a bound on every wait: generous, for a busy machine


async def test_two_stop_signals_that_arrive_together_end_the_grace(tmp_path: Path) -> None:
    """SIGINT and SIGTERM read by the loop at once: the first stops claiming, the second ends
    the sends' grace (an hour here) at once; the run still ends its tasks."""
    sent = asyncio.Event()

    async def send(event: dict[str, Any], token: int | None = None) -> object:
        sent.set()
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")

    async with AsyncQueue.open(str(tmp_path / "q.db")) as queue:
        await queue.enqueue({"id": "j1", "qty": 1})
        dispatcher = Dispatcher(queue, send, owner="w", grace_s=3600)
        running = asyncio.ensure_future(dispatcher.run(follow=True))
        await asyncio.wait_for(sent.wait(), WAIT_S)
        with stop_signals(running):
            os.kill(os.getpid(), signal.SIGINT)  # (both bytes wait in the loop's wakeup pipe)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(asyncio.wait([running]), WAIT_S)
        assert running.cancelled()
        assert dispatcher.summary.done == 0  # the send was abandoned: its job stays leased
