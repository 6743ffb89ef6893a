"""A job's budget when its caller names none: the product surfaces' defaults.

``DEFAULT_TTL_MS`` is a day: a job outlives an overnight outage of its partner, well
inside ``PRODUCT``'s 30 days, and an order older than a day is for a person to look at
(``redrive``), not for a retry loop.  ``DEFAULT_MAX_ATTEMPTS`` is 5: the Dispatcher's
breaker keeps a sink outage from spending attempts (an unreachable sink is sent again
under the same lease), so attempts count only real refusals and timeouts, and five of
those in a row say the job itself is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from asnackq.core import worker as w

__all__ = ["DEFAULT_MAX_ATTEMPTS", "DEFAULT_TTL_MS", "Budget", "Intake", "Item", "intakes"]

DEFAULT_TTL_MS = w.DAY_MS
DEFAULT_MAX_ATTEMPTS = 5

Intake = tuple[dict[str, Any], int, int]  # (event, ttl_ms, max_attempts)
Item = dict[str, Any] | Intake  # a plain event gets the queue's budget


class Budget(NamedTuple):
    """The ttl and attempts a job gets when its caller names none (checked by ``of``)."""

    ttl_ms: int = DEFAULT_TTL_MS
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    @classmethod
    def of(cls, ttl_ms: object, max_attempts: object, limits: w.Limits) -> Budget:
        """A budget in ``limits``' ranges (``ttl_ms`` None: a day, or ``limits``' longest
        ttl if shorter); a ValueError names the argument and its range."""
        if ttl_ms is None:
            ttl_ms = min(DEFAULT_TTL_MS, limits.ttl_ms)
        return cls(
            w.check_int(ttl_ms, "ttl_ms", 1, limits.ttl_ms),
            w.check_int(max_attempts, "max_attempts", 1, 16),
        )

    def fill(self, ttl_ms: object, max_attempts: object) -> tuple[object, object]:
        """The caller's values, this budget's where they are None."""
        return (
            self.ttl_ms if ttl_ms is None else ttl_ms,
            self.max_attempts if max_attempts is None else max_attempts,
        )


def intakes(items: Iterable[object], budget: Budget) -> list[tuple[object, object, object]]:
    """``(event, ttl_ms, max_attempts)`` for each item: a plain dict gets ``budget``; a
    triple is passed on as it is (the core's plan validates it)."""
    out: list[tuple[object, object, object]] = []
    for item in items:
        if isinstance(item, dict):
            out.append((item, budget.ttl_ms, budget.max_attempts))
        elif isinstance(item, tuple | list) and len(item) == 3:
            out.append((item[0], item[1], item[2]))
        else:
            raise ValueError(
                f"each item must be an event or (event, ttl_ms, max_attempts): {item!r}"
            )
    return out
