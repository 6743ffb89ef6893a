"""The tests' own orderings: the Sequencer's turns and the loop clock's moves."""

from __future__ import annotations

import asyncio

import pytest

from .sequencer import LoopClock, Sequencer, until


async def test_blocks_run_in_the_order_of_their_positions_whatever_the_arrivals():
    seq, seen = Sequencer(), []

    async def turn(position):
        async with seq(position):
            seen.append(position)
            await asyncio.sleep(0)  # (a turn may await: the next one still waits)
            seen.append(-position)

    await asyncio.gather(*(turn(p) for p in (3, 1, 0, 2)))
    assert seen == [0, 0, 1, -1, 2, -2, 3, -3]


async def test_a_position_is_taken_once():
    seq = Sequencer()
    async with seq(0):
        pass
    with pytest.raises(RuntimeError, match="taken"):
        async with seq(0):
            pass


async def test_a_cancelled_wait_breaks_the_sequencer_for_every_other_turn():
    seq = Sequencer()

    async def turn(position):
        async with seq(position):
            pass

    waiting = asyncio.ensure_future(turn(1))
    later = asyncio.ensure_future(turn(2))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(RuntimeError, match="broken"):
        await asyncio.wait_for(later, 60)


async def test_advancing_the_loop_clock_ends_a_long_sleep_at_once(loop_clock):
    loop = asyncio.get_running_loop()
    began = loop.time()
    sleeping = asyncio.ensure_future(asyncio.sleep(3600))
    await asyncio.sleep(0)
    loop_clock.advance(3600)
    await asyncio.wait_for(sleeping, 60)  # (the wait_for's 60 s are the loop's too)
    assert loop.time() - began >= 3600
    with pytest.raises(ValueError, match="forward only"):
        loop_clock.advance(-1)


def test_the_loop_clock_is_the_real_clock_plus_every_advance():
    readings = iter([10.0, 10.5])
    clock = LoopClock(lambda: next(readings))
    assert clock.time() == 10.0
    clock.advance(2.0)
    assert clock.time() == 12.5


async def test_until_returns_once_the_condition_holds_and_fails_on_a_timeout(loop_clock):
    flag = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, flag.set)
    await until(flag.is_set)
    waiting = asyncio.ensure_future(until(lambda: False, within_s=3600))
    await asyncio.sleep(0)
    loop_clock.advance(3600)
    with pytest.raises(TimeoutError):
        await waiting
