"""A send waiting for the breaker's probe turn is cancelled when its run stops, even when the
turn is handed to it in the same moment: a lost cancellation left a stopping run's send
probing for ever (Python 3.11's ``asyncio.wait_for`` returns a result that meets a cancel)."""

from __future__ import annotations

import asyncio

import pytest

from asnackq.dispatch.breaker import Breaker, BreakerPolicy


@pytest.mark.parametrize("turns", range(6))  # the cancel at each step of the hand-over
async def test_a_send_cancelled_as_it_gets_the_probes_turn_stays_cancelled(turns: int) -> None:
    breaker = Breaker(BreakerPolicy(after=1, base_ms=10, max_ms=10), on_close=lambda: None)
    breaker.closed.clear()  # open (as ``_open`` leaves it, its probe due at once): sends wait
    breaker.is_open = True  # for their turn to probe
    await breaker._turn.acquire()  # another send is the probe in flight
    waiting = asyncio.ensure_future(breaker.admit(60))
    for _ in range(3):
        await asyncio.sleep(0)  # it waits for the turn
    breaker._turn.release()  # the turn goes to it ...
    for _ in range(turns):
        await asyncio.sleep(0)
    if waiting.done():  # admitted before the run stopped: it is the probe now
        assert waiting.result() is True and breaker._turn.locked()
        return
    waiting.cancel()  # ... as the run stops
    done, _ = await asyncio.wait([waiting], timeout=30)
    assert done and waiting.cancelled()  # never admitted as the probe
    assert not breaker._turn.locked()  # the turn passed on
