"""A run's fixed parameters, shared by its parts (committer, pacer, delivery coroutines)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asnackq.core import worker as w

if TYPE_CHECKING:
    from asnackq.dispatch.spans import DeliverySpans

__all__ = ["Settings", "Trace"]

# trace(kind, ticket, clock reading, status): kind "claim" (status None) or "finish"
# (status: the finish's result, False when stale).  Called outside any transaction.
Trace = Callable[[str, w.Ticket, int, "str | bool | None"], None]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """A run's fixed parameters, shared by its parts."""

    owner: str
    concurrency: int
    lease_ms: int
    clock: Callable[[], int]
    jitter: Callable[[], float]
    idle_ms: int
    gather_ms: int
    prefetch: int | None
    trace: Trace | None
    retry: w.Retry
    limits: w.Limits
    spans: DeliverySpans | None = None  # None: the run is not traced

    @property
    def gather_s(self) -> float:
        """How long results may gather: ``gather_ms``, at most a tenth of the lease."""
        return min(self.gather_ms, self.lease_ms // 10) / 1000
