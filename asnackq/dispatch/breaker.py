"""A circuit breaker for a run's sends: pause while the sink is away, probe one at a time.

Rules of this module:

* Only ``Unavailable`` failures count: the sink refused, reset, timed out or answered
  502-504.  Any other answer (an ACK, a rejection, a bad ACK) shows the sink is there.
  The pause's cause is the last failure's: ``timing_out`` (no answer in time), ``tls``
  (TLS refused: this worker's set-up or the sink's certificate, ``why`` names it) or
  ``away``; its opening, first probe and closing are events (``asnackq.dispatch.events``).
* ``after`` such failures in a row open the breaker: no send passes but one probe at a
  time, the first ``base_ms`` after the opening, each next ``base_ms`` doubled (up to
  ``max_ms``) after the last probe found no sink.  The next probe's time is fixed when the
  last one fails, not when a send starts waiting for it: a send whose lease ends sooner
  gives its turn back and waits again, and the probe still goes at that time, however
  short the leases are against the longest wait.
  Any answer from the sink closes it, and every waiting send goes at once.
* The breaker only gates sends.  The job whose send found no sink stays held (its lease
  kept) and is sent again under the same lease: the sink's absence never spends an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from asnackq.core import worker as w
from asnackq.dispatch.events import Events

__all__ = ["PAUSED", "Breaker", "BreakerPolicy"]

PAUSED = {  # the ``paused`` event's message, by cause
    "away": "paused: the sink is away (no connection, refused, reset or 502-504)",
    "timing_out": "paused: the sink is timing out (no answer within the sender's timeout)",
    "tls": "paused: TLS with the sink fails",
}


@dataclass(frozen=True, kw_only=True)
class BreakerPolicy:
    """When the breaker opens (``after`` failures in a row) and how it probes."""

    after: int = 8
    base_ms: int = 100
    max_ms: int = 2000

    def check(self) -> BreakerPolicy:
        w.check_int(self.after, "breaker after", 1, 10_000)
        w.check_int(self.base_ms, "breaker base_ms", 1, w.HOUR_MS)
        w.check_int(self.max_ms, "breaker max_ms", self.base_ms, w.HOUR_MS)
        return self


@dataclass(kw_only=True)
class BreakerCounts:
    """What the breaker did during a run."""

    outages: int = 0  # times it opened
    probes: int = 0  # sends let through while open
    paused_ms: int = 0  # time spent open


class Breaker:
    """Gate each send with ``probe = await admit()``, then report with ``record`` (the
    committer's alone: a coroutine's samples reach it as values)."""

    def __init__(
        self, policy: BreakerPolicy, on_close: Callable[[], None], events: Events | None = None
    ) -> None:
        self.policy = policy.check()
        self.events = events or Events("")
        self.cause, self.why = "away", ""  # the last failure's
        self.counts = BreakerCounts()
        self.closed = asyncio.Event()
        self.closed.set()
        self._turn = asyncio.Lock()  # held by the one probe in flight
        self._on_close = on_close
        self._in_a_row = 0
        self._wait_ms = policy.base_ms
        self._probe_at = 0.0  # (loop time) when the next probe may go
        self._opened_at = 0.0
        self._probes_at_open = 0
        self._stopped = False
        self.is_open = False  # (``closed`` is clear exactly while it is open)

    async def admit(self, within_s: float) -> bool | None:
        """Wait until a send may go: True if it goes as the probe (then ``record`` it), False
        if the breaker is closed, None if the wait would outlast ``within_s`` seconds."""
        if not self.is_open:
            return False
        loop = asyncio.get_running_loop()
        give_up = loop.time() + within_s
        # ``asyncio.timeout``, never ``wait_for``: Python 3.11's ``wait_for`` returns the
        # result of a wait that ends as its caller is cancelled, and the cancellation is lost
        # (a stopping run's send would then go on probing, its lease kept, for ever).
        try:
            async with asyncio.timeout(within_s):
                await self._turn.acquire()
        except TimeoutError:
            return None
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self._probe_at, give_up) - loop.time()):
                    await self.closed.wait()
        except BaseException:  # cancelled: the turn passes on
            self._turn.release()
            raise
        if not self.is_open or loop.time() < self._probe_at:
            self._turn.release()  # closed meanwhile, or the lease ends before the probe's time
            return False if not self.is_open else None
        if self.counts.probes == self._probes_at_open:  # the pause's first probe
            self.events.emit(
                "probing",
                "probing: one send at a time until the sink answers",
                outage=self.counts.outages,
            )
        return True

    def record(
        self, probe: bool | None, unavailable: bool | None, cause: str = "away", why: str = ""
    ) -> None:
        """The send admitted with ``probe`` found no sink (True; ``cause``: why, see the
        module), an answer (False), or did not happen (None)."""
        if unavailable:
            self._in_a_row += 1
            self.cause, self.why = cause, why
            if probe:
                self._wait_ms = min(2 * self._wait_ms, self.policy.max_ms)
                self._probe_at = asyncio.get_running_loop().time() + self._wait_ms / 1000
            elif not self.is_open and self._in_a_row >= self.policy.after:
                self._open()
        elif unavailable is False:
            self._in_a_row = 0
            if self.is_open:
                self._close()
        if probe:
            self.counts.probes += 1
            self._turn.release()

    def paused_ms_so_far(self) -> int:
        """Time spent open, an outage still going on counted up to now."""
        going_on = self.is_open and not self._stopped
        return self.counts.paused_ms + (self._elapsed_ms() if going_on else 0)

    def stop(self) -> None:
        """The run is over: count an outage still going on."""
        self._stopped = True
        if self.is_open:
            self.counts.paused_ms += self._elapsed_ms()
            self._opened_at = asyncio.get_running_loop().time()

    def _open(self) -> None:
        self.closed.clear()
        self.is_open = True
        self._opened_at = asyncio.get_running_loop().time()
        self._wait_ms = self.policy.base_ms
        self._probe_at = self._opened_at + self._wait_ms / 1000
        self.counts.outages += 1
        self._probes_at_open = self.counts.probes
        self.events.emit(
            "paused",
            PAUSED[self.cause],
            logging.WARNING,
            cause=self.cause,
            **({"why": self.why} if self.why else {}),
            failures=self._in_a_row,
            outage=self.counts.outages,
        )

    def _close(self) -> None:
        paused_ms = self._elapsed_ms()
        self.counts.paused_ms += paused_ms
        self.closed.set()
        self.is_open = False
        self._on_close()
        self.events.emit(
            "resumed",
            "resumed: the sink answers",
            paused_ms=paused_ms,
            probes=self.counts.probes - self._probes_at_open,
            outage=self.counts.outages,
        )

    def _elapsed_ms(self) -> int:
        return round((asyncio.get_running_loop().time() - self._opened_at) * 1000)
