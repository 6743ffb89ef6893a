"""A stop signal asked for twice is two cancellations, even when both arrive together; one
asked while a run is set up, or while the command loads, is a stop."""

from __future__ import annotations

import asyncio
import gc
import importlib.abc
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from asnackq import command
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.cli.common import ended, setting_up, stop_signals

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


async def test_a_stop_during_the_set_up_is_a_stop_even_if_its_cancellation_is_taken_in() -> None:
    """``asnackq work`` stopped by Ctrl-C while it set its run up: asyncio.run's handler
    cancelled the set-up, a step took the cancellation in, and the run went on (a second
    Ctrl-C ended it); or the cancellation ended the set-up with its run already started,
    which then failed on the closed queue ("Task exception was never retrieved")."""
    taken_in = asyncio.Event()

    async def a_step_that_takes_it_in() -> None:
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            taken_in.set()

    async def set_up(signum: int | None, step: Callable[[], Awaitable[None]]) -> None:
        with setting_up() as go_on:
            if signum is not None:
                os.kill(os.getpid(), signum)
            await step()
            go_on()  # (where the run would begin)

    with pytest.raises(KeyboardInterrupt):
        await set_up(signal.SIGINT, a_step_that_takes_it_in)
    assert taken_in.is_set()
    with pytest.raises(KeyboardInterrupt):  # (its cancellation ends the set-up)
        await set_up(signal.SIGTERM, lambda: asyncio.sleep(WAIT_S))
    await set_up(None, lambda: asyncio.sleep(0))  # (no signal: the run begins)


async def test_a_run_left_early_is_ended_and_its_failure_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def runs() -> None:
        await asyncio.sleep(WAIT_S)

    async def fails() -> None:
        raise RuntimeError("the queue is closed")

    running, failed = asyncio.ensure_future(runs()), asyncio.ensure_future(fails())
    await asyncio.wait([failed])
    await ended(running)
    await ended(failed)
    assert running.cancelled() and isinstance(failed.exception(), RuntimeError)
    del running, failed
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_ctrl_c_while_the_command_loads_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line's modules take a fifth of a second to load; a Ctrl-C meanwhile was
    a traceback of KeyboardInterrupt."""

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, *args: Any) -> None:
            if name == "asnackq.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "asnackq.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert command.main() == 130
    assert capsys.readouterr().err == "asnackq: interrupted\n"
