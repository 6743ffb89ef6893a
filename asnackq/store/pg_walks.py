"""Where a PostgreSQL session's claims start their walk: floors past the index entries that
no scan can drop while an old snapshot is held.

Rules of this module:

* Every claim changes its job's ``status``, so each leaves its row's old version and that
  version's index entries behind (``jobs_by_status``: pending by seq; ``jobs_by_lease``:
  leased by lease end; ``jobs_by_deadline``).  A scan drops an entry it finds dead to every
  snapshot, and a vacuum removes it; while some transaction on the server holds an old
  snapshot (a long report, a backup, a replica's feedback), neither can, and every claim
  steps again over the entries of every job claimed since, all at the front of its walk.
* So a session's claim walks from a floor: pending jobs from the seq of the first job its
  last claim of that kind took (``seq >= from_seq``, an index condition); the quarantine's
  check of pending and leased jobs by deadline from the run's clock at its last check (a
  check that finds a spent job is followed by the quarantine, which walks from the front).
  The claim's lapsed leases are read by its walks from the front only: a floor on a lease's
  end is no index condition of ``jobs_by_status``, which a planner whose statistics count
  few leases walks for them (58 ms a claim at 300,000 jobs under a held snapshot, against
  0.3 ms without that part).  The rows a walk finds are the statement's own, in its order, with
  its locks and every condition: a floor only says where the index scan starts, or that a
  part waits for the next walk from the front.
* A claim from a floor that comes up short is read again from the front, in the same
  transaction: a claim never takes fewer jobs than a walk from the front would.  Only while
  walks from the floor fill every claim (a backlog) does a job that became claimable behind
  it (a retry falling due, a scheduled job, a job whose claim rolled back or whose intake
  committed late, a lease another worker let lapse) wait for the next walk from the front:
  at most once every ``FULL_S`` (a second) while those walks are quick, and whenever the
  run's clock is behind its floor (a clock stepped back).  The scheduled walks from the
  front of all the floored statements take at most a tenth of the session's time together
  while they take under a second in all: each statement walks from the front every ten
  times the sum of their last walks' times (two statements whose walks take 0.2 and 0.3 s:
  each every 5 s; statements sent at once each count the time of all, which only makes the
  share smaller; a statement read again from the front in its transaction, after the
  quarantine, counts both reads; another statement that has not been sent for twice
  ``MOST_S`` is no longer in use and counts no more), and at least every ``MOST_S``
  (ten seconds) however long they took, so that no job waits longer than that behind a
  floor (then those walks take more than a tenth), but for a scout's walk (below).  A claim
  from a floor that comes up short is read from the front at once, outside this schedule.  A
  walk's time includes any stall of its event loop or wait for a lock, and the statements
  sent at once with it (``pg.AtOnce``).
* A claim's walk from the front that took ``SCOUT_S`` or more (a held snapshot's dead
  entries: about 2 s each after ten minutes at 6,000 jobs a second, for which the session's
  every transaction waited) makes the next one due a scout's (``Walks.scout``: the store's),
  one walk for both claim statements in use (sent within twice ``MOST_S``; ``SCOUTS``,
  ``SCOUTED``): the claim of any claimable job's statement from the front without its row
  locks, and from the first pending job it finds, the fresh claim's for its first job never
  attempted (the fresh claim's jobs are among the other's pending ones), on a session of its
  own, while the claims go on from their floors.  Each statement's claim after it is back
  walks from the first job it would take that the scout found, if behind its floor, and the
  claim of any job reads the lapsed leases if it found one; its time is each statement's
  walk time for the schedule (its period, and its share beside the others'), both
  statements' next walks from the front are due from its start, and a scout quicker than
  ``SCOUT_S`` has the claims walk from the front again.  A scout that failed has the next
  claim walk from the front at once, as does one on its way for ``SCOUT_WAIT_S`` (stopped: a
  scout that cannot finish keeps no job behind a floor for longer).  One scout goes at a time
  (each timed alone): a statement whose turn comes while another's is on its way waits for
  it, ``SCOUT_WAIT_S`` at most from its last walk, then walks from the front itself.  So a
  job behind a floor waits for a scout's walk too: one that became claimable after a scout
  began waits for the next one, which starts ``MOST_S`` after it or once it is back,
  whichever is later, and for that one's walk; each scout is stopped after ``SCOUT_WAIT_S``,
  so at most twice that.  A transaction that rolls back leaves the scouts' findings it used
  to its re-run, and a scout it sent goes on, its schedule with it.  A scout's time is its
  walk's: not the wait for its session (a stopped scout's, still closing it, or the
  connect of a new one) before it.  A loop stall counts in a
  walk's time: a busy machine can start the scouts too (their session is closed once no
  scout has used it for a minute: ``pg_session.SCOUT_IDLE_S``).
  Only the claims are scouted: the quarantine's check walks little from the front (no
  deadline lies in the past but those of jobs it is about to end).
* Floors hold for a whole transaction: a statement read again in it (a claim read again
  after the quarantine) walks from its first read's floors, so the second read takes the
  lapsed leases the first read found (and locked), never a fuller set from the floor.
* Floors are kept by the session's store, in memory; a store without them (a new one, the
  sync driver, a lane's claims) walks from the front.  Only the product's claims
  (``Limits.max_losses``: ``SQL_NEXT_RECLAIMABLE``, ``SQL_NEXT_FRESH_RECLAIMING``) and
  their quarantine's check (``SQL_QUARANTINE_DUE_RECLAIMING``) take floors.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asnackq.core import worker as w
from asnackq.store.pg_sql import STATEMENTS

__all__ = [
    "FLOORED",
    "FULL_S",
    "LOWEST",
    "MOST_S",
    "SCOUTED",
    "SCOUTS",
    "SCOUT_S",
    "Scout",
    "Walks",
]

FULL_S = 1.0  # a walk from the front at most this often (seconds of time.monotonic)
MOST_S = 10 * FULL_S  # ... and, however long they took, at least this often
SHARE = 10  # a walk from the front every SHARE times the last ones' time, in all
LOWEST = -(2**62)  # a floor below every seq, lease end and deadline: a walk from the front
SCOUT_S = 0.2  # a claim's walk from the front that took this long is scouted from then on
SCOUT_WAIT_S = 3 * MOST_S  # ... by a scout that may take this long (then the claim walks)

_PENDING = "WHERE status = ANY(ARRAY['pending']) AND "
_EXPIRED = "WHERE status = 'leased' AND lease_until <= %(now)s AND deadline + 0 > %(now)s"
_DUE_PENDING = "status = (SELECT 'pending'::text) AND deadline <= %(now)s ORDER BY"
_DUE_LEASED = (
    "status = (SELECT 'leased'::text) AND lease_until <= %(now)s AND deadline <= %(now)s ORDER BY"
)
_DUE_FROM = " AND deadline >= %(from_time)s ORDER BY"


def _floored(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise AssertionError(f"not one {old!r} in {' '.join(text.split())[:80]!r}")
    return text.replace(old, new)


# Each floored statement's text: the walking text with the floors as index conditions; the
# claim's read of lapsed leases runs only on a walk from the front (``%(front)s``: a plan's
# one-time filter, so a walk from a floor does not scan for them at all).  The check reads
# the first pending and the first leased job whose deadline passed since its floor, each in
# ``jobs_by_deadline``'s order (``pg_sql``) and from that index alone: a lease ends by its
# job's deadline (every lease and extension is ``least(..., deadline)``), so a leased job
# whose deadline passed is spent, its lease lapsed, and the lease's end needs no reading.
# (With a filter on it, a plan read the partial ``jobs_by_lease`` whole and sorted it: its
# statistics, from a sample without leases, counted none while it held an entry for every
# lease taken since a held snapshot began, 53 ms a check.)
FLOORED = {
    w.SQL_NEXT_RECLAIMABLE: _floored(
        _floored(
            STATEMENTS[w.SQL_NEXT_RECLAIMABLE], _PENDING, _PENDING + "seq >= %(from_seq)s AND "
        ),
        _EXPIRED,
        _EXPIRED + " AND %(front)s",
    ),
    w.SQL_NEXT_FRESH_RECLAIMING: _floored(
        STATEMENTS[w.SQL_NEXT_FRESH_RECLAIMING], _PENDING, _PENDING + "seq >= %(from_seq)s AND "
    ),
    w.SQL_QUARANTINE_DUE_RECLAIMING: _floored(
        _floored(
            STATEMENTS[w.SQL_QUARANTINE_DUE_RECLAIMING],
            _DUE_PENDING,
            _DUE_PENDING.replace(" ORDER BY", _DUE_FROM),
        ),
        _DUE_LEASED,
        _DUE_PENDING.replace("'pending'", "'leased'").replace(" ORDER BY", _DUE_FROM),
    ),
}


def _unlocked(text: str) -> str:
    text = text.replace(" FOR UPDATE SKIP LOCKED", "")
    if "FOR UPDATE" in text:
        raise AssertionError("a scout takes no row lock")
    return text


def _scouted_text(claim: str, fresh: str) -> str:
    """The two claims' walk from the front as a scout reads it: the claim of any job's
    statement without its row locks (it takes nothing; the claim that follows it does),
    without the reclaims' count (each claim counts its own) and without the LIMIT over its
    parts (so the first pending job it walks to is in its rows, however many lapsed leases
    come before it); and the fresh claim's statement, for its first job, read from that
    first pending job on (the index scan starts there: past the dead entries)."""
    head, reclaims = _unlocked(claim).split("SELECT *, true, ")
    count, rest = reclaims.split("\nFROM expired\nORDER BY seq LIMIT %(n)s")
    if rest or "%(losses)s" not in count:
        raise AssertionError("not a claim of pending jobs and lapsed leases")
    first = _floored(
        _floored(_unlocked(fresh), "seq >= %(from_seq)s", "seq >= (SELECT min(seq) FROM pending)"),
        "LIMIT %(n)s",
        "LIMIT 1",
    )
    return f"{head}SELECT *, true, 0::bigint\nFROM expired\nUNION ALL\n({first})\nORDER BY seq"


# The claims' walk from the front as a scout reads it, on a session of its own, for both
# scouted statements at once (``SCOUTS``: the claim of any claimable job, and the fresh
# claim, whose jobs, never attempted, are among the other's pending jobs): one walk over
# the dead entries, where each statement walked them on a scout of its own.  Its rows:
# the first pending jobs, the lapsed leases, and the first job never attempted (read from
# the first pending job on, however many due retries come before it).
SCOUTS = (w.SQL_NEXT_RECLAIMABLE, w.SQL_NEXT_FRESH_RECLAIMING)
SCOUTED = _scouted_text(FLOORED[SCOUTS[0]], FLOORED[SCOUTS[1]])

# A scout: ``(sql, params, begun)`` -> the walk's rows, where ``begun()`` is called as the
# walk itself starts, once its session is there (the wait for it is no walk's time).
Scout = Callable[[str, dict[str, Any], Callable[[], None]], Awaitable[list[tuple[Any, ...]]]]


class Walks:
    """One session's floors: for each floored statement, where its next walk starts."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, scout: Scout | None = None
    ) -> None:
        self.clock = clock
        self.scout = scout  # a walk from the front on a session of its own (None: none)
        self.scouts: dict[str, asyncio.Future[tuple[list[tuple[Any, ...]], float]]] = {}
        self.stopped: set[asyncio.Future[Any]] = set()  # scouts cancelled, perhaps not ended
        self.launched: dict[str, float] = {}  # the clock at each statement's last scout's start
        self.seq: dict[str, int] = {}  # pending walks: the first seq to read
        self.time: dict[str, int] = {}  # deadline walks: the run's clock (ms)
        self.fronts: dict[str, float] = {}  # the clock at each statement's last walk from the front
        self.sent: dict[str, float] = {}  # the clock when each statement was last sent (in use)
        self.every: dict[str, float] = {}  # the seconds from one walk from the front to the next
        self.took: dict[str, float] = {}  # the seconds each statement's last one took
        self.within: dict[str, dict[str, Any]] = {}  # each statement's floors in this transaction
        self.timed: set[str] = set()  # the statements whose walk from the front is being timed
        self.rereads: dict[str, float] = {}  # the clock at a timed read again (this transaction)
        self.taken: set[str] = set()  # the statements whose scout this transaction took or stopped
        self.sending: tuple[float, list[str]] = (0.0, [])  # its scout's start, and given to
        self.before: tuple[dict[str, Any], ...] = ({}, {}, {}, {}, {})  # as at ``begin``
        self.scouts_before: dict[str, asyncio.Future[Any]] = {}  # ``scouts`` as at ``begin``

    def begin(self) -> None:
        """A transaction begins: its statements take their floors afresh."""
        self.within.clear()
        self.timed.clear()
        self.rereads.clear()
        self.taken.clear()
        self.sending = (0.0, [])
        self.before = tuple(dict(kept) for kept in self._kept())
        self.scouts_before = dict(self.scouts)

    def _kept(self) -> tuple[dict[str, Any], ...]:
        return self.seq, self.time, self.fronts, self.every, self.took

    def rollback(self) -> None:
        """The transaction rolled back (or its COMMIT's fate is unknown): the floors are as
        it found them, so its plan run again walks as the first try did (lower floors only
        ever read more)."""
        self.seq, self.time, self.fronts, self.every, self.took = (
            dict(kept) for kept in self.before
        )
        # (a scout's finding the transaction used is used again; one it launched goes on,
        # for each statement it was given to, and their next walks from the front are due
        # from its start, as without the rollback)
        at, given = self.sending
        self.fronts.update((sql, at) for sql in given)
        self.scouts.update(
            (sql, self.scouts_before[sql]) for sql in self.taken if sql in self.scouts_before
        )

    def floored(self, sql: str, params: object) -> tuple[str, dict[str, Any]] | None:
        """The statement's floored text and parameters, or None (not a floored statement).  A
        statement read again in one transaction (a claim read again after the quarantine)
        walks from where its first read did: a lapsed lease that read took is taken again."""
        text = FLOORED.get(sql)
        if text is None or not isinstance(params, dict):
            return None
        if (first := self.within.get(sql)) is not None:
            front = first["from_seq"] == first["from_time"] == LOWEST
            if front and sql not in self.timed:  # (adds to the first's)
                self.rereads[sql] = self.clock()
                self.timed.add(sql)
            return text, {**params, **self.within[sql]}
        now = params["now"]
        from_seq, from_time = self.seq.get(sql, LOWEST), self.time.get(sql, LOWEST)
        at = self.sent[sql] = self.clock()
        lapsed = False
        due = at - self.fronts.get(sql, -math.inf) >= self.every.get(sql, FULL_S)
        scout = self.scouts.get(sql)
        if from_time > now:
            from_seq = from_time = LOWEST
        elif (
            scout is not None
            and not scout.done()
            and at - self.launched.get(sql, -math.inf) < SCOUT_WAIT_S
        ):
            pass  # (its scout is on its way: from the floor meanwhile)
        elif scout is not None and not scout.done():
            # (too long on its way: the claim walks from the front itself, and so does the
            # other statement's next claim, which finds it stopped)
            scout.cancel()
            self.stopped = {stopped for stopped in self.stopped if not stopped.done()}
            self.stopped.add(self.scouts.pop(sql))
            self.taken.add(sql)
            from_seq = from_time = LOWEST
        elif scout is not None:
            del self.scouts[sql]
            self.taken.add(sql)
            if (scouted := self._scouted(sql, scout)) is None:
                from_seq = from_time = LOWEST  # (the scout failed: from the front at once)
            else:
                below, lapsed = scouted
                from_seq = from_seq if below is None else min(from_seq, below)
        elif (scouted_due := due and self._scouts(sql, from_seq)) and self._idle():
            launched = asyncio.ensure_future(self._scouting(params))
            self.sending = (at, [each for each in SCOUTS if self._in_use(each, at)])
            for each in self.sending[1]:  # (one walk for both in use: their schedules too)
                self.fronts[each] = self.launched[each] = at
                self.scouts[each] = launched
        elif scouted_due and at - self.fronts.get(sql, -math.inf) < SCOUT_WAIT_S:
            pass  # (another statement's scout is on its way: this one's goes after it)
        elif due:
            from_seq = from_time = LOWEST
        front = from_seq == from_time == LOWEST
        if front:
            self.fronts[sql] = at
            self.timed.add(sql)
        self.within[sql] = {"from_seq": from_seq, "from_time": from_time, "front": front or lapsed}
        return text, {**params, **self.within[sql]}

    def _scouts(self, sql: str, from_seq: int) -> bool:
        """Whether the claim's walk from the front, now due, is a scout's instead: a claim
        from a floor whose last walk from the front was slow (``SCOUT_S``), with a scout
        given."""
        return (
            self.scout is not None
            and sql in SCOUTS
            and from_seq != LOWEST
            and self.took.get(sql, 0.0) >= SCOUT_S
        )

    def _in_use(self, sql: str, at: float) -> bool:
        """Whether the statement was sent within twice ``MOST_S`` of ``at``."""
        return at - self.sent.get(sql, -math.inf) <= 2 * MOST_S

    def _idle(self) -> bool:
        """Whether no scout is on its way: one goes at a time, so each is timed alone."""
        return all(scout.done() for scout in self.scouts.values())

    async def _scouting(self, params: dict[str, Any]) -> tuple[list[tuple[Any, ...]], float]:
        """The scout's walk from the front as at ``params`` (a scouted statement's): its
        rows, its time (from its start on its session: the wait for that session is not timed)."""
        assert self.scout is not None
        start = self.clock()

        def begun() -> None:
            nonlocal start
            start = self.clock()

        walked = {"now": params["now"], "n": params["n"], "from_seq": LOWEST, "front": True}
        rows = await self.scout(SCOUTED, walked, begun)
        return rows, max(0.0, self.clock() - start)

    def _scouted(
        self, sql: str, scout: asyncio.Future[tuple[list[tuple[Any, ...]], float]]
    ) -> tuple[int | None, bool] | None:
        """What the statement's scout, back, found: the first seq of a pending job the
        statement would take (None: none; the fresh claim's: never attempted) and whether it
        found a lapsed lease; None if it failed.  Its time is the statement's walk time
        (``found``'s schedule), as a walk from the front's is."""
        if scout.cancelled() or scout.exception() is not None:
            return None
        rows, took = scout.result()
        self.took[sql] = took
        self.every[sql] = min(MOST_S, max(FULL_S, SHARE * took))
        fresh = sql == SCOUTS[1]
        pending = [row[0] for row in rows if not row[6] and not (fresh and row[3])]
        return (min(pending) if pending else None), any(row[6] for row in rows)

    def stop(self) -> list[asyncio.Future[Any]]:
        """Cancel the scouts on their way (a store closing): the ones to wait for, once
        their session is closed (a scout's query then ends at once, where a cancelled one
        waits for the server to end it)."""
        scouts = [*self.scouts.values(), *self.stopped, *self.scouts_before.values()]
        self.scouts, self.scouts_before = {}, {}
        self.stopped.clear()
        for scout in scouts:
            scout.cancel()
        return [scout for scout in set(scouts) if not scout.done()]

    def again(self, sql: str, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters of a walk from the front after ``params``' came up short."""
        self.fronts[sql] = self.clock()
        self.timed.add(sql)
        self.within[sql] = {"from_seq": LOWEST, "from_time": LOWEST, "front": True}
        return {**params, **self.within[sql]}

    def found(self, sql: str, params: dict[str, Any], rows: Sequence[Sequence[Any]]) -> bool:
        """What a floored statement's walk (``params``: its floors) found: the next floors.
        True: a claim from a floor came up short, so the caller reads it again from the front
        (the same transaction: its own locks are no obstacle), and a claim never takes fewer
        jobs than a walk from the front would."""
        if sql in self.timed:  # (walks from the front: a tenth of the session's time, in all)
            self.timed.discard(sql)
            at = self.clock()
            reread = self.rereads.pop(sql, None)
            took = at - self.fronts[sql] if reread is None else self.took.get(sql, 0) + at - reread
            self.took[sql] = max(0.0, took)  # (an injected clock may step back)
            # (of the statements still walking: each in use walks at least every MOST_S)
            in_all = sum(t for s, t in self.took.items() if s == sql or self._in_use(s, at))
            self.every[sql] = min(MOST_S, max(FULL_S, SHARE * in_all))
        if sql == w.SQL_QUARANTINE_DUE_RECLAIMING:
            self.time[sql] = params["now"]  # (what was spent by now, the quarantine ends)
            return False
        short = len(rows) < params["n"]
        pending = [row[0] for row in rows if not row[6]]  # (the claim's own, not reclaims)
        self.seq[sql] = LOWEST if short or not pending else min(pending)
        return short and bool(params["from_seq"] != LOWEST)
