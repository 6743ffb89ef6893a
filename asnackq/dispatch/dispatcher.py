"""The Dispatcher: many delivery coroutines over one ``AsyncQueue``, in three parts.

* ``Committer`` (``asnackq.dispatch.committer``) owns every transaction and every ticket the run
  holds: finishes in; claims, extensions and tickets out, one transaction per cycle, the
  results of busy coroutines gathered for up to ``gather_ms``.
* ``deliver`` is one delivery coroutine: take a ticket, send it (again, while the sink is
  not there: see ``breaker``), hand the result back - through its ``Port``, never the
  committer itself.
* ``Dispatcher.run`` is the lifecycle: start, drain, close, cancel (``Phase``).

Rules of this module:

* Coroutines never touch the queue: they send, and hand results back to the committer.
* A coroutine sends a ticket only while the run holds its lease; a lost ticket is never
  sent again, and its result is dropped.
* The clock's reading at a claim is the delivery's first reading; the coroutine takes the
  second when the send returns, exactly as ``run_once`` does.  Both come from the run's
  ``RunClock``: a wall clock stepped back holds the run's time, never ends the run.
* Every task the run creates is awaited and its exception retrieved, on every path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
from collections.abc import Callable
from typing import Literal

from asnackq.core import worker as w
from asnackq.core.rate import check_rate
from asnackq.dispatch.breaker import Breaker, BreakerPolicy
from asnackq.dispatch.committer import Committer
from asnackq.dispatch.gate import Gate
from asnackq.dispatch.port import Claimed, Port, Sent
from asnackq.dispatch.runclock import RunClock
from asnackq.dispatch.settings import Settings, SharedRate, Trace
from asnackq.dispatch.spans import DeliverySpans
from asnackq.dispatch.summary import Summary
from asnackq.store.aio import NOT_AN_INTAKE, AsyncQueue, AsyncSend

DEFAULT_BREAKER = BreakerPolicy()
FLOOR_WAIT_MAX_S = 1.0  # a latency floor above this is no pace for a sink that asked none

__all__ = ["Dispatcher"]


async def deliver(port: Port, send: AsyncSend) -> None:
    """One delivery coroutine: take a ticket, wait for its slot of a shared rate, send it,
    hand the result back; until None.  With a gate (concurrency "auto"), a slot of the gate
    is held from the take to the hand-back."""
    spans = port.settings.spans
    while True:
        if port.gate is not None:
            await port.gate.acquire()
        try:
            if (claimed := await port.take()) is None:
                return
            if not await port.slot(claimed):  # a shared rate's slot: lost while it waited
                port.hand_back(Sent(claimed, None))
                continue
            attached = None if spans is None else spans.begin(claimed)
            try:
                sent = await send_until_answered(port, send, claimed)
            except Exception:  # a bad clock or jitter: the run fails, the job
                port.hand_back(Sent(claimed, None, failure="errors"))  # stays leased
                port.drain()
                raise
            finally:
                if spans is not None:
                    spans.detach(attached)
        finally:
            if port.gate is not None:
                port.gate.release()
        if spans is not None:
            spans.sent(sent)
        port.hand_back(sent)


async def send_until_answered(port: Port, send: AsyncSend, claimed: Claimed) -> Sent:
    """Send a ticket, and again under the same lease while the sink is not there.

    Classified like ``run_once``; an ``Unavailable`` failure is not an outcome: the send
    goes again (paced by the retry policy, gated by the breaker) for as long as the run
    keeps the lease - up to the job's deadline.  Nor is an ``Overloaded`` answer: the send
    goes again under the same lease once the wait the sink asked for is over (see
    ``wait_overload``).  Under a shared rate every send takes a slot: a re-send a new one.
    """
    gate = port.gate
    settings, breaker, summary = port.settings, port.breaker, port.summary
    ticket, again = claimed.ticket, 0
    while True:
        probe = await breaker.admit(port.lease_left_s(ticket)) if breaker.is_open else False
        if (again or probe is not False) and not port.keeps(ticket):
            breaker.record(probe, None)  # (a first send's ticket was just checked)
            return Sent(claimed, None)  # lost, or at its deadline: no answer
        if probe is None:
            continue  # the lease was extended meanwhile
        if again and not await port.slot(claimed, again=True):  # a shared rate's new slot
            breaker.record(probe, None)
            return Sent(claimed, None)  # lost while it waited
        summary.requests += 1
        if again:
            summary.resent += 1
        again += 1
        jitter = w.check_jitter(settings.jitter())
        try:
            event = w.fresh_event(ticket)
            sending = (
                send(event, ticket["token"])
                if gate is None
                else gate.send(send, event, ticket["token"])
            )
            outcome = w.judge_send(
                ticket, jitter, await sending, None, settings.retry, settings.limits
            )
        except w.Overloaded as error:
            breaker.record(probe, False)  # the sink is there
            summary.overloaded += 1
            if not await wait_overload(port, claimed, error, again, jitter):
                return Sent(claimed, None)  # the lease ended meanwhile: no answer
            continue
        except w.Unavailable:
            breaker.record(probe, True)
            if not breaker.is_open:
                await asyncio.sleep(
                    settings.retry.delay(min(again, 16), jitter, settings.limits) / 1000
                )
            continue
        except (w.Retryable, w.Permanent) as error:
            outcome = w.judge_send(ticket, jitter, None, error, settings.retry, settings.limits)
        except Exception as error:  # stays leased; reclaimed after the lease
            breaker.record(probe, False if isinstance(error, w.BadAck) else None)
            return Sent(
                claimed, None, failure="bad_acks" if isinstance(error, w.BadAck) else "errors"
            )
        breaker.record(probe, False)
        return Sent(claimed, *outcome_at(port, claimed, outcome))


async def wait_overload(
    port: Port, claimed: Claimed, error: w.Overloaded, again: int, jitter: float
) -> bool:
    """Wait out an overload under the ticket's lease; False if the lease ended first.

    The wait is what the sink asked for.  A sink that asked for none (no ``Retry-After``,
    or ``0``: a slot frees within a second) is sent again after the retry policy's delay;
    under concurrency "auto", after about one latency floor (the sink's quickest answer so
    far, times 0.5 to 1.5, doubled for each overload of the same ticket, at most the retry
    policy's cap), and then through the gate, whose limit the overload has just cut.  The
    coroutine keeps its place meanwhile: under "auto" a sink refusing every request meets
    no more tickets than the gate's bound.
    """
    settings, gate = port.settings, port.gate
    wait_s = error.retry_after_s
    if wait_s:
        return await port.hold(claimed.ticket, wait_s)
    if gate is not None and gate.rule.floor_s < FLOOR_WAIT_MAX_S:
        backoff = gate.rule.floor_s * (0.5 + jitter) * 2 ** min(again - 1, 16)
        return await port.hold(claimed.ticket, min(backoff, settings.retry.cap_ms / 1000))
    delay_ms = settings.retry.delay(min(again, 16), jitter, settings.limits)
    return await port.hold(claimed.ticket, delay_ms / 1000)


def outcome_at(port: Port, claimed: Claimed, outcome: tuple[str, int]) -> tuple[str, int, int]:
    """The outcome with the delivery's second clock reading: ``(outcome, now_ms, delay)``."""
    now = w.second_reading(port.now, claimed.first, port.settings.limits)
    return outcome[0], now, outcome[1]


class Dispatcher:
    """Many delivery coroutines over one AsyncQueue, each job following ``run_once``'s contract.

    One committer task runs every transaction (see ``Committer``); ``concurrency``
    coroutines only send.  ``concurrency="auto"``: ``max_concurrency`` coroutines, of which
    as many send at once as an adaptive limit lets (``asnackq.dispatch.adaptive``).
    ``prefetch`` fixes how many tickets are kept claimed ahead of demand (default:
    adaptive).  ``gather_ms`` (at most a tenth of the lease is used) is
    how long results may wait for more while every coroutine is busy; 0 settles each
    batch as soon as the last transaction ends.  ``retry`` is the delay before a job's next
    attempt (and between re-sends while the sink is away); ``breaker`` when to pause for an
    outage.  ``clock`` is the queue's unless given.  ``rate`` (sends a second, with bursts
    of at most ``burst``) caps the sends of every worker of the queue together: its
    permits are taken with the claims (``asnackq.core.rate``), each ticket sent no earlier
    than its slot; it becomes the queue's rate, which a run given none keeps to as well,
    looking for it at its start and every ``RATE_CHECK_S`` (``settings.rate``: the run's
    now; ``AsyncQueue.clear_rate`` removes it).
    Ranges are the queue's ``limits``.  ``summary`` is the current (or last) run's.
    """

    def __init__(
        self,
        queue: AsyncQueue,
        send: AsyncSend,
        *,
        owner: str,
        concurrency: int | Literal["auto"] = 64,
        max_concurrency: int = 256,
        lease_ms: int = 5000,
        clock: Callable[[], int] | None = None,
        jitter: Callable[[], float] = random.random,
        grace_s: float = 5.0,
        idle_ms: int = 20,
        gather_ms: int = 10,
        trace: Trace | None = None,
        prefetch: int | None = None,
        retry: w.Retry = w.RUN_ONCE_RETRY,
        breaker: BreakerPolicy = DEFAULT_BREAKER,
        rate: float | None = None,
        burst: int = 1,
    ) -> None:
        limits = queue.limits
        if queue.intakes_only:
            raise ValueError(NOT_AN_INTAKE)
        if clock is None:
            clock = queue.clock
        w.check_run_args(owner, clock, send, 0.5, lease_ms, limits)
        check_send(send)
        w.check_int(max_concurrency, "max_concurrency", 1, 1024)
        self.adaptive = concurrency == "auto"
        if not self.adaptive:
            w.check_int(concurrency, "concurrency", 1, 1024)
        w.check_int(idle_ms, "idle_ms", 1, 60_000)
        w.check_int(gather_ms, "gather_ms", 0, 1000)
        if type(grace_s) not in (int, float) or not 0 <= grace_s <= 3600:
            raise ValueError(f"grace_s must be a number of seconds in 0..3600: {grace_s!r}")
        retry.check(limits)
        breaker.check()
        shared = None if rate is None else check_rate(rate, burst)
        if prefetch is not None:
            w.check_int(prefetch, "prefetch", 0, 1024)
        timeout_s = getattr(send, "timeout_s", None)
        if timeout_s is not None and timeout_s * 1000 >= lease_ms:
            raise ValueError(
                f"the sender's timeout ({timeout_s}s) must be below the lease "
                f"({lease_ms}ms): a late ACK would arrive after the lease ended"
            )
        self.queue, self.send, self.grace_s, self.breaker = queue, send, grace_s, breaker
        self.rate = shared  # None: the queue's, if it has one, at each run's start
        self.settings = Settings(
            owner=owner,
            concurrency=max_concurrency if concurrency == "auto" else concurrency,
            lease_ms=lease_ms,
            clock=clock,
            jitter=jitter,
            idle_ms=idle_ms,
            gather_ms=gather_ms,
            prefetch=prefetch,
            trace=trace,
            retry=retry,
            limits=limits,
            shared=SharedRate(shared, own=shared is not None),
            spans=DeliverySpans.of(owner),
        )
        self.summary = Summary()
        self._breaker: Breaker | None = None
        self._committer: Committer | None = None
        self._clock: RunClock | None = None
        self._gate: Gate | None = None

    @property
    def paused(self) -> bool:
        """Whether the current run is paused by its circuit breaker (the sink is away)."""
        return self._breaker is not None and self._breaker.is_open

    @property
    def db_down(self) -> bool:
        """Whether the queue's database is away right now (its store is reconnecting)."""
        return self.queue.health is not None and self.queue.health.down

    def snapshot(self) -> dict[str, int]:
        """The current (or last) run's counts so far; the circuit breaker's and the clock's
        are live too (``summary`` gets them when the run ends)."""
        counts = self.summary.as_dict()
        if self._committer is not None:
            counts.update(self._committer.db_counts())
        if self._breaker is not None:
            live = self._breaker.counts
            counts.update(
                outages=live.outages, probes=live.probes, paused_ms=self._breaker.paused_ms_so_far()
            )
        if self._clock is not None:
            counts.update(clock_steps=self._clock.steps, clock_step_ms=self._clock.largest_ms)
        if self._gate is not None:
            counts.update(concurrency=self._gate.limit, concurrency_cuts=self._gate.rule.cuts)
        return counts

    async def run(
        self, *, until_empty: bool = True, max_jobs: int | None = None, follow: bool = False
    ) -> Summary:
        """Deliver until the queue holds no pending or leased job (or ``max_jobs`` claims).

        ``until_empty=False``: stop as soon as nothing is claimable.  ``follow=True``: never
        stop on an empty queue; poll until cancelled (or ``max_jobs`` claims).  On
        cancellation: claim nothing more, let sends in flight (and tickets held) finish
        within ``grace_s``, commit their results, and re-raise.
        """
        if max_jobs is not None:
            w.check_int(max_jobs, "max_jobs", 0, 10**12)
        if self.rate is not None:  # the queue's row: this rate for every worker
            await self.queue.limit_rate(self.rate)
        else:  # the queue's, if it has one (looked for again as the run goes on)
            self.settings.shared.rate = await self.queue.shared_rate()
        committer = Committer(self.queue, self.settings, max_jobs, self.breaker)
        if self.settings.rate is not None:
            await committer.slots.probe(self.queue, asyncio.get_running_loop().time)
        self.summary, self._breaker, self._clock = (
            committer.summary,
            committer.breaker,
            committer.now,
        )
        self._committer = committer
        loop = asyncio.ensure_future(committer.run(until_empty, follow))
        port = committer.port()
        self.summary.concurrency = self.settings.concurrency
        if self.adaptive:
            self._gate = Gate(self.settings.concurrency)
            committer.pacer.concurrency = lambda: self._gate.limit if self._gate else 1
            committer.pacer.per_send = 0  # the gate lets a line of holders wait instead
            port = dataclasses.replace(port, gate=self._gate)
        workers = [
            asyncio.ensure_future(deliver(port, self.send))
            for _ in range(self.settings.concurrency)
        ]
        try:
            await asyncio.wait(workers)  # unlike gather, a cancelled wait spares the workers
        except asyncio.CancelledError:
            self._limit_in_summary()
            committer.drain()
            _, late = await asyncio.wait(workers, timeout=self.grace_s)
            for task in late:  # abandoned jobs stay leased and are reclaimed later
                task.cancel()
            await asyncio.wait(workers)
            await committer.close(loop)
            first_failure([loop, *workers])
            raise
        await committer.close(loop)
        self._limit_in_summary()
        failure = first_failure([loop, *workers]) or committer.failure
        if failure is not None:  # a coroutine's unexpected failure is the run's
            raise failure
        return self.summary

    def _limit_in_summary(self) -> None:
        """Concurrency "auto": the summary's concurrency is the adaptive limit (a run
        stopped by cancellation included)."""
        if self._gate is not None:
            self.summary.concurrency = self._gate.limit
            self.summary.concurrency_cuts = self._gate.rule.cuts


def check_send(send: object) -> None:
    """Refuse a ``send`` the run could not await as ``await send(event, token)``: one that
    does not take two positional arguments, or is not async (a coroutine function, an
    object with an async ``__call__``, or a function annotated to return an awaitable)."""
    try:
        signature = inspect.signature(send)  # type: ignore[arg-type]  # (checked callable)
    except (TypeError, ValueError):  # a builtin without one: judged by its first send
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"send must accept (event, token) positionally; its signature is {signature}"
        ) from None
    call = getattr(send, "__call__", None)  # noqa: B004  # (its own __call__, if an object)
    annotation = str(signature.return_annotation)
    if not (
        inspect.iscoroutinefunction(send)
        or inspect.iscoroutinefunction(call)
        or any(kind in annotation for kind in ("Awaitable", "Coroutine", "Future"))
    ):
        raise ValueError(
            f"send must be async (async def, or an object with an async __call__): {send!r}"
        )


def first_failure(tasks: list[asyncio.Future[None]]) -> BaseException | None:
    """The first exception of these finished tasks; every task's is retrieved, so none is
    ever reported as "never retrieved"."""
    failures = [task.exception() for task in tasks if not task.cancelled()]
    return next((failure for failure in failures if failure is not None), None)
