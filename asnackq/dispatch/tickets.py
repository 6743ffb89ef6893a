"""The values that travel between a run's delivery coroutines and its committer: ``Claimed``
out (a ticket with its first clock reading and send slot); a ``Report`` of each pass of a send
loop (told as values, not built into one) and ``Sent`` (a ticket's result) back: what the
coroutine saw."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from asnackq.core import worker as w
from asnackq.store.attempts import Record

__all__ = ["Claimed", "Report", "Sent", "made"]

# A value of a delivery's path built with every field given, as ``made(Sent, (claimed,
# outcome, now_ms, delay_ms, None, False))``: a NamedTuple's own constructor is a Python
# call (for its defaults), run several times a job.
made = tuple.__new__


class Claimed(NamedTuple):
    """A ticket as claimed, the clock reading of its claim (the delivery's first), and its
    send slot under a shared rate (the event loop's clock; 0: none)."""

    ticket: w.Ticket
    first: int
    not_before: float = 0.0


class Sent(NamedTuple):
    """What a coroutine hands back: the outcome of one send, or why there is none."""

    claimed: Claimed
    outcome: str | None  # ok / retry / permanent; None: nothing to finish
    now_ms: int = 0  # the second clock reading
    delay_ms: int = 0
    failure: str | None = None  # "bad_acks" or "errors" when outcome is None
    fatal: bool = False  # the coroutine fails the run: claim nothing more


class Report(Protocol):
    """How one pass of a coroutine's send loop is told: whether a request went out (``sent``;
    again under the same lease: ``resent``; answered with an overload: ``overloaded``), and
    the breaker's sample - the admission it passed with (``probe``: True, False, or None
    for none) and what the sink showed (``unavailable``: True no sink, False an answer, None
    no send; ``cause``: why no sink - ``away``, ``timing_out`` or ``tls``, with ``why``);
    the request's answer, kept (``record``: ``asnackq.store.attempts``)."""

    def __call__(
        self,
        probe: bool | None,
        unavailable: bool | None,
        sent: bool = False,
        resent: bool = False,
        overloaded: bool = False,
        cause: str = "away",
        why: str = "",
        record: Record | None = None,
        /,
    ) -> None: ...
