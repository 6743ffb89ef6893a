"""A shared send rate as the sink sees it: requests per one-second window.

Rules of this module:

* ``recording_sink`` is the project's sink on 127.0.0.1 port 0 in the running event loop,
  noting the event loop's time of every ``POST /events`` as it arrives (before any
  judgement): what the sink sees, not what the workers meant to send.  A watchdog notes
  each spell the loop itself was held up (``STALL_S`` or more late): requests that came
  during one are noted only at its end, bunched, so their true spacing is unknown.
* ``pace`` judges arrivals against a rate: the largest count in any one-second window
  (sliding: every window that starts at an arrival and ends within the run) after the
  first second, and the mean rate over that span.  A window that overlaps a stall of the
  recording loop is not judged (``unjudged`` counts them);
  the mean counts every arrival.  Pure, standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from aiohttp import web

from asnackq.aio import AsyncQueue
from asnackq.http_sink import SERVER_OPTIONS, SinkConfig, make_app
from asnackq.lab.procs import command

__all__ = [
    "CAP_SHARE",
    "KEEP_SHARE",
    "Pace",
    "Run",
    "Stall",
    "fill",
    "pace",
    "paced_run",
    "recording_sink",
    "watch_stalls",
]

CAP_SHARE = 1.1  # no one-second window above rate x 1.1
KEEP_SHARE = 0.9  # a mean of at least rate x 0.9
WINDOW_S = 1.0
STALL_S = 0.05  # a watchdog tick this late means the loop was held up: arrivals bunched
TICK_S = 0.01


class Pace(NamedTuple):
    """Arrivals judged against ``rate``: counted from ``skip_s`` after the first one."""

    rate: float
    requests: int  # every arrival
    seconds: float  # the span judged
    max_window: int  # the most arrivals in one judged window of the span
    mean: float  # arrivals per second over the span
    unjudged: int = 0  # windows (one starts at each arrival) left out for the recorder's stalls

    @property
    def capped(self) -> bool:
        """No window above ``rate`` x ``CAP_SHARE``."""
        return self.max_window <= self.rate * CAP_SHARE

    @property
    def kept(self) -> bool:
        """A mean of at least ``rate`` x ``KEEP_SHARE``."""
        return self.mean >= self.rate * KEEP_SHARE

    def as_dict(self) -> dict[str, Any]:
        return {
            **self._asdict(),
            "max_window_per_rate": round(self.max_window / self.rate, 3),
            "mean_per_rate": round(self.mean / self.rate, 3),
            "capped": self.capped,
            "kept": self.kept,
        }


Stall = tuple[float, float]  # (from, to) on the recording loop's clock: held up


def pace(
    arrivals: Sequence[float],
    rate: float,
    skip_s: float = WINDOW_S,
    stalls: Sequence[Stall] = (),
) -> Pace:
    """Judge ``arrivals`` (seconds, any order) against ``rate`` sends a second, leaving out
    the windows that overlap one of the recorder's ``stalls``."""
    times = sorted(arrivals)
    if not times:
        return Pace(rate, 0, 0.0, 0, 0.0)
    span = [t for t in times if t >= times[0] + skip_s]
    if len(span) < 2:
        return Pace(rate, len(times), 0.0, len(span), 0.0)
    seconds = span[-1] - span[0]
    most, end, unjudged = 0, 0, 0
    for start, at in enumerate(span):
        if at + WINDOW_S > span[-1]:
            break  # a window past the last arrival would count too few
        while end < len(span) and span[end] < at + WINDOW_S:
            end += 1
        if any(held_to >= at and held_from < at + WINDOW_S for held_from, held_to in stalls):
            unjudged += 1
        else:
            most = max(most, end - start)
    mean = (len(span) - 1) / seconds if seconds > 0 else 0.0
    return Pace(rate, len(times), round(seconds, 3), most, round(mean, 2), unjudged)


async def watch_stalls(stalls: list[Stall]) -> None:
    """Note every spell this loop was held up ``STALL_S`` or more (until cancelled)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + TICK_S
        await asyncio.sleep(TICK_S)
        if loop.time() - due >= STALL_S:
            stalls.append((due, loop.time()))


@contextlib.asynccontextmanager
async def recording_sink(
    db: Path | str, stalls: list[Stall] | None = None
) -> AsyncIterator[tuple[str, list[float]]]:
    """The sink on port 0 with ``db`` as its inbox: its ``/events`` URL and the list the
    arrival time (the event loop's clock) of each ``POST /events`` is appended to; with
    ``stalls``, the loop's own stalls are appended to it (``watch_stalls``)."""
    arrivals: list[float] = []

    @web.middleware
    async def note(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "POST" and request.path == "/events":
            arrivals.append(asyncio.get_running_loop().time())
        response: web.StreamResponse = await handler(request)
        return response

    app = make_app(SinkConfig(db))
    app.middlewares.insert(0, note)
    runner = web.AppRunner(app, access_log=None, **SERVER_OPTIONS)
    await runner.setup()
    watchdog = None if stalls is None else asyncio.ensure_future(watch_stalls(stalls))
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}/events", arrivals
    finally:
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        await runner.cleanup()


async def fill(queue: Path | str, jobs: int) -> None:
    """Enqueue ``jobs`` jobs ``j0``, ``j1``, ... (qty 1) on a queue file or URL."""
    async with AsyncQueue.open(queue) as opened:
        for first in range(0, jobs, 500):
            events = [{"id": f"j{i}", "qty": 1} for i in range(first, min(first + 500, jobs))]
            await opened.enqueue_many(events)


class Run(NamedTuple):
    """A paced run: the sink's arrivals judged, each worker's exit code and summary, and
    the arrivals (the event loop's clock)."""

    pace: Pace
    codes: list[int | None]
    summaries: list[dict[str, Any]]
    arrivals: list[float]


async def paced_run(
    queue: Path | str,
    sink_db: Path | str,
    rate: float,
    workers: Sequence[Sequence[object]],
    burst: int = 1,
    timeout_s: float = 120.0,
) -> Run:
    """Run one ``asnackq work QUEUE --rate RATE --burst BURST --until-empty`` process per
    item of ``workers`` (its extra options) against a recording sink, until each ends; the
    windows its own stalls bunched are left unjudged."""
    stalls: list[Stall] = []
    async with recording_sink(sink_db, stalls) as (url, arrivals):
        procs = [
            await asyncio.create_subprocess_exec(
                *command("work", queue, "--sink", url, "--rate", rate, "--burst", burst),
                *map(str, ("--until-empty", "--json", *options)),
                stdout=asyncio.subprocess.PIPE,
            )
            for options in workers
        ]
        try:
            outs = await asyncio.wait_for(
                asyncio.gather(*(proc.communicate() for proc in procs)), timeout_s
            )
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    summaries = [json.loads(out) if out else {} for out, _ in outs]
    codes = [proc.returncode for proc in procs]
    return Run(pace(arrivals, rate, stalls=stalls), codes, summaries, arrivals)
