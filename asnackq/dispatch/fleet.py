"""One worker for every endpoint of a queue: a Dispatcher per endpoint, each in its lane.

Rules of this module:

* The queue's endpoints (``asnackq.core.endpoints``) are read in one statement every
  ``refresh_s``; each enabled endpoint has one ``Dispatcher`` of its own, on the queue's
  connection and lock (``AsyncQueue.in_lane``: its claims take that endpoint's deliveries
  and nothing else), sending through an ``EndpointSend`` fed with the row as last read.
  So each endpoint has its own breaker, pacing (its own rate row, ``AsyncQueue.rate_key``;
  429/Retry-After; concurrency fixed or "auto") and in-flight limit: an endpoint that is
  away, throttled or at its limit claims nothing more, spends no attempts beyond its
  breaker's probes, and never stands between another endpoint and its deliveries.
* What a Dispatcher is made with (``plan``: concurrency, rate and burst, retry schedule,
  order) comes from the row: when it changes the endpoint's Dispatcher is stopped (no more
  claims, sends in flight finish, results committed) and a new one started.  What a send is
  made with (URL, secrets, timeout, success rule, headers) is the ``EndpointSend``'s to
  follow, without a restart.
* A disabled or removed endpoint has no Dispatcher: none of its deliveries is claimed, so
  none spends an attempt, until it is enabled again (a 410 disables it: ``EndpointSend``).
* Nothing of the routing lives only here: the rows and the jobs are the state, so a worker
  killed at any point loses nothing, and one started again resumes every endpoint.
* While the database is away the endpoints as last read go on (each Dispatcher outlasts
  the outage as a single run does); a Dispatcher that fails is logged and started again
  after ``refresh_s``.
* Idle lanes poll for new deliveries every ``idle_ms``, by default longer the more
  endpoints there are (``idle_ms_for``), so that idle endpoints cost the database a bounded
  number of claims a second; ``wake`` makes them look at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from asnackq.aio import AsyncQueue, Dispatcher, Summary, default_owner
from asnackq.core import endpoints as ep
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.dispatch.endpoint import EndpointSend
from asnackq.store.outage import StoreUnavailable
from asnackq.store.targets import one_line

__all__ = ["IDLE_MS_MAX", "Fleet", "idle_ms_for", "plan"]

log = logging.getLogger("asnackq.worker")

REFRESH_S = 1.0
AUTO_MAX = 64  # concurrency "auto": the most sends in flight to one endpoint
IDLE_MS_MIN = 20
IDLE_MS_MAX = 500
IDLE_CLAIMS_PER_S = 400  # what every idle lane together may ask of the database a second
# an endpoint's lane takes retry delays as long as its schedule's (``endpoints.MAX_DELAY_MS``)
LANE_LIMITS = w.PRODUCT._replace(delay_ms=max(w.PRODUCT.delay_ms, ep.MAX_DELAY_MS))


def plan(endpoint: ep.Endpoint) -> tuple[object, ...]:
    """What an endpoint's Dispatcher is made with: a change of it starts a new one."""
    return (endpoint.concurrency, endpoint.rate, endpoint.burst, endpoint.retry, endpoint.ordered)


def idle_ms_for(lanes_count: int) -> int:
    """How often an idle lane polls when ``lanes_count`` lanes run: 20 ms, longer past
    eight lanes (at most ``IDLE_CLAIMS_PER_S`` idle claims a second, polls at most 0.5 s
    apart)."""
    wanted = 1000 * max(1, lanes_count) // IDLE_CLAIMS_PER_S
    return max(IDLE_MS_MIN, min(IDLE_MS_MAX, wanted))


@dataclass
class Running:
    """An endpoint's Dispatcher as it runs."""

    made_with: tuple[object, ...]
    dispatcher: Dispatcher
    task: asyncio.Future[Summary]
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


class Fleet:
    """Deliver every endpoint's deliveries of ``queue``: ``await Fleet(queue).run()``.

    ``owner`` names the leases of every endpoint's Dispatcher; ``sender_options`` go to each
    ``EndpointSend`` (``allow_remote``, ``allow_networks``, TLS files); ``options`` to each
    ``Dispatcher`` (``lease_ms``, ``breaker``, ``retry`` - the pace of re-sends while an
    endpoint is away -, ``gather_ms``, ``keep_attempts``, ``grace_s``, ``jitter``, ``clock``,
    ``trace``, ``prefetch``).  ``max_concurrency``: the most sends in flight to an endpoint
    whose concurrency is "auto".  ``idle_ms``: how often an idle lane looks for new
    deliveries (None: ``idle_ms_for`` the number of endpoints).  ``on_start(name,
    dispatcher)`` and ``on_stop(name, dispatcher)`` are called as endpoints' Dispatchers
    start and end (a metrics exporter follows them so).
    """

    def __init__(
        self,
        queue: AsyncQueue,
        *,
        owner: str | None = None,
        refresh_s: float = REFRESH_S,
        max_concurrency: int = AUTO_MAX,
        idle_ms: int | None = None,
        sender_options: dict[str, Any] | None = None,
        on_start: Callable[[str, Dispatcher], object] | None = None,
        on_stop: Callable[[str, Dispatcher], object] | None = None,
        **options: Any,
    ) -> None:
        if queue.intakes_only or queue.lane is not None:
            raise ValueError("a fleet runs on a queue of its own (AsyncQueue.connect), no lane")
        if type(refresh_s) not in (int, float) or not 0.01 <= refresh_s <= 60:
            raise ValueError(f"refresh_s must be a number of seconds in 0.01..60: {refresh_s!r}")
        w.check_int(max_concurrency, "max_concurrency", 1, 1024)
        if idle_ms is not None:
            w.check_int(idle_ms, "idle_ms", 1, 60_000)
        for hook in (on_start, on_stop):
            if hook is not None and not callable(hook):
                raise ValueError(f"on_start and on_stop must be callable: {hook!r}")
        self.queue, self.refresh_s = queue, refresh_s
        self.owner = owner if owner is not None else default_owner()
        w.check_identifier(self.owner, "owner")
        self.max_concurrency, self.idle_ms = max_concurrency, idle_ms
        self.sender_options = dict(sender_options or {})
        self.options = options
        self.on_start, self.on_stop = on_start, on_stop
        self.rows: dict[str, ep.Endpoint] = {}  # the endpoints as last read
        self.running: dict[str, Running] = {}
        self.summaries: dict[str, Summary] = {}  # each endpoint's runs, added up
        self.failures = 0  # Dispatchers that failed (started again)
        self._wake = asyncio.Event()
        self._follow = True  # each Dispatcher's run: until cancelled, or until its lane empties
        # Dispatchers are checked when made: a bad option is refused before any run
        Dispatcher(queue, _never_sent, owner=self.owner, **options)

    def dispatchers(self) -> dict[str, Dispatcher]:
        """The running Dispatchers, by endpoint."""
        return {name: running.dispatcher for name, running in self.running.items()}

    def wake(self, endpoints: Iterable[str] | None = None) -> None:
        """New deliveries were enqueued (for ``endpoints``; None: any): their lanes look now,
        not at their next idle poll."""
        names = self.running if endpoints is None else endpoints
        for name in names:
            running = self.running.get(name)
            if running is not None:
                running.dispatcher.wake()
        self._wake.set()

    async def run(self, *, until_empty: bool = False) -> dict[str, Summary]:
        """Deliver until cancelled (or, ``until_empty``, until every enabled endpoint's
        lane holds no pending or leased delivery); each endpoint's summary."""
        self._follow = not until_empty
        try:
            await self._refresh()
            while not (until_empty and not self.running):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.refresh_s)
                await self._reap(until_empty)
                if not until_empty:
                    await self._refresh()
        finally:
            await asyncio.shield(self._stop_all())
        return self.summaries

    async def _refresh(self) -> None:
        """Read the endpoints; start, restart and stop Dispatchers to match."""
        try:
            rows = {row.name: row for row in await self.queue.endpoints()}
        except StoreUnavailable:
            return  # the endpoints as last read go on
        self.rows = rows
        for name in [name for name in self.running if self._stale(name)]:
            await self._stop(name)
        idle_ms = self.idle_ms or idle_ms_for(sum(row.state == "enabled" for row in rows.values()))
        for name, row in rows.items():
            if row.state == "enabled" and name not in self.running:
                await self._start(row, idle_ms)

    def _stale(self, name: str) -> bool:
        row = self.rows.get(name)
        return row is None or row.state != "enabled" or plan(row) != self.running[name].made_with

    async def _start(self, row: ep.Endpoint, idle_ms: int) -> None:
        lane = self.queue.in_lane(lanes.Lane(row.name))
        lane.limits = LANE_LIMITS
        stack = contextlib.AsyncExitStack()
        try:
            if row.rate is None:  # none of its own: an earlier rate row binds it no more
                await lane.clear_rate()
            send = await stack.enter_async_context(
                EndpointSend(
                    row.name,
                    read=partial(self._row, row.name),
                    disable=partial(self.queue.disable_endpoint, row.name),
                    payload=self.queue.delivery,
                    refresh_s=self.refresh_s,
                    **self.sender_options,
                )
            )
            dispatcher = Dispatcher(lane, send, **self._dispatcher_options(row, idle_ms))
        except (ValueError, StoreUnavailable) as error:
            await stack.aclose()
            log.warning("endpoint %s not started: %s", row.name, one_line(error))
            return
        except BaseException:  # (cancelled while it started: its senders closed)
            await asyncio.shield(stack.aclose())
            raise
        task = asyncio.ensure_future(dispatcher.run(follow=self._follow))
        self.running[row.name] = Running(plan(row), dispatcher, task, stack)
        if self.on_start is not None:
            self.on_start(row.name, dispatcher)

    def _dispatcher_options(self, row: ep.Endpoint, idle_ms: int) -> dict[str, Any]:
        concurrency = row.concurrency
        return {
            "owner": self.owner,
            "idle_ms": idle_ms,
            **self.options,
            "concurrency": concurrency,
            "max_concurrency": self.max_concurrency if concurrency == "auto" else concurrency,
            "schedule": ep.schedule_of(row),
            "rate": row.rate,
            "burst": row.burst,
        }

    async def _row(self, name: str) -> ep.Endpoint:
        row = self.rows.get(name)
        if row is None:
            raise ep.NoSuchEndpoint(f"no endpoint {name!r}")
        return row

    async def _reap(self, until_empty: bool) -> None:
        """Dispatchers that ended: emptied (``until_empty``) or failed (started again at
        the next refresh)."""
        for name, running in list(self.running.items()):
            if running.task.done():
                failure = None if running.task.cancelled() else running.task.exception()
                if failure is not None:
                    self.failures += 1
                    log.error("endpoint %s: its run failed: %s", name, one_line(failure))
                await self._stop(name)

    async def _stop(self, name: str) -> None:
        """Stop an endpoint's Dispatcher as a cancellation does: no more claims, sends in
        flight get its grace, their results are committed."""
        running = self.running.pop(name)
        running.task.cancel()
        await asyncio.wait([running.task])
        add(self.summaries, name, running.dispatcher.summary)
        await running.stack.aclose()
        if self.on_stop is not None:
            self.on_stop(name, running.dispatcher)

    async def _stop_all(self) -> None:
        for running in self.running.values():
            running.task.cancel()  # (every one winds down at once)
        for name in list(self.running):
            await self._stop(name)


def add(summaries: dict[str, Summary], name: str, summary: Summary) -> None:
    """Add ``summary``'s counts to ``name``'s."""
    before = summaries.get(name)
    if before is None:
        summaries[name] = summary
        return
    for key, value in summary.as_dict().items():
        if isinstance(value, int) and isinstance(getattr(before, key, None), int):
            setattr(before, key, getattr(before, key) + value)


async def _never_sent(event: dict[str, Any], token: int | None = None) -> object:
    raise AssertionError("a fleet's options are checked with this send: it is never called")
