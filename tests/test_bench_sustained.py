"""``benchmarks/sustained.py --control``: a paused queue enqueues and delivers nothing, the
control runs in its window and is purged after it, and no job that waited across a pause
counts in a claim latency."""

from __future__ import annotations

import argparse
import asyncio
import math
import sqlite3
from pathlib import Path

import pytest

from .benches import loaded
from .sequencer import until

bench = loaded("sustained")


def ticket(job_id: str) -> dict[str, object]:
    return {"id": job_id, "qty": 1, "owner": "o", "token": 1, "attempt": 1, "lease_until": 1}


def test_a_job_that_waited_across_a_pause_counts_in_no_claim_latency(monkeypatch) -> None:
    load = bench.Load()
    clock = iter([1_000, 2_000])  # the pause's start, then its end
    monkeypatch.setattr(bench, "epoch_ms", lambda: next(clock))
    load.born = {"early": 500, "late": 2_500, "during": 1_500, "before": 400}
    load.trace("claim", ticket("before"), 900, None)  # claimed before the pause: counted
    load.pause()
    load.trace("claim", ticket("during"), 1_600, None)  # claimed during it: not
    load.resume()
    load.trace("claim", ticket("early"), 2_100, None)  # enqueued before its end: not
    load.trace("claim", ticket("late"), 2_600, None)  # enqueued after it: counted
    assert load.latencies == [500, 100]
    assert load.born == {}


def jobs(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as con:
        return dict(con.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())


async def test_the_control_runs_in_its_window_alone_and_is_purged_after_it(
    tmp_path, monkeypatch
) -> None:
    args = argparse.Namespace(
        control=1.0, depth=40, concurrency=4, send_ms=0.0, ids="ordered", kept_answers=True
    )
    measured, control = tmp_path / "q.db", tmp_path / "control.db"
    async with (
        bench.streaming(str(measured), args) as load,
        bench.streaming(str(control), args) as checked,
    ):
        checked.pause()
        ended: list[tuple[int, int]] = []  # the measured queue's counts as the window ends
        purge = bench.purge

        def purged(*how):  # (called once the control is paused, before the measured resumes)
            ended.append((load.done, load.enqueued))
            return purge(*how)

        monkeypatch.setattr(bench, "purge", purged)
        await until(lambda: load.done >= 100)  # the measured queue runs
        window = asyncio.ensure_future(bench.controlled(load, checked, args.control, str(control)))
        await until(checked.active.is_set)
        paused = (load.done, load.enqueued)
        rate, p50 = await asyncio.wait_for(window, 60)
        [during] = ended
        assert load.active.is_set() and not checked.active.is_set()
        assert rate > 0 and not math.isnan(p50)  # the control's claims were measured
        # while the control ran, the measured queue only finished what it held (at most
        # its depth, and a batch enqueued as the pause began): far fewer than it delivers
        # in that time when running (more than 100 above)
        assert during[1] - paused[1] <= args.depth
        assert during[0] - paused[0] <= 2 * args.depth
        # the control's done jobs were purged after its window (but the sends already past
        # their gate when it paused: at most its depth)
        assert jobs(control).get("done", 0) <= args.depth < checked.done
        await until(lambda: load.done >= during[0] + 100)  # the measured queue runs again


@pytest.mark.parametrize(("ids", "kept_answers"), [("random", False), ("ordered", True)])
async def test_the_ids_and_the_kept_answers_are_as_asked(tmp_path, ids, kept_answers) -> None:
    """``--ids random``: ids of 32 hex digits, each new, where ``ordered`` numbers them;
    ``--no-kept-answers``: the Dispatcher keeps no request's answer (kept by default)."""
    args = argparse.Namespace(
        control=0.0, depth=40, concurrency=4, send_ms=0.0, ids=ids, kept_answers=kept_answers
    )
    path = tmp_path / "q.db"
    async with bench.streaming(str(path), args) as load:
        await until(lambda: load.done >= 100)
    with sqlite3.connect(path) as con:
        found = [row[0] for row in con.execute("SELECT id FROM jobs")]
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master")}
        kept = 0
        if "asnackq_attempts" in tables:
            kept = con.execute("SELECT count(*) FROM asnackq_attempts").fetchone()[0]
    assert len(found) >= 100 and len(set(found)) == len(found)
    if ids == "random":
        assert all(len(i) == 32 and int(i, 16) >= 0 for i in found)
    else:
        assert {f"j{n}" for n in range(100)} <= set(found)
    assert (kept >= 100) if kept_answers else kept == 0
