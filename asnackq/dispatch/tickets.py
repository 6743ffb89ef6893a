"""The values that travel between a run's delivery coroutines and its committer: ``Claimed``
out (a ticket with its first clock reading and send slot), ``Sent`` back (what the
coroutine saw)."""

from __future__ import annotations

from typing import NamedTuple

from asnackq.core import worker as w

__all__ = ["Claimed", "Sent"]


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
