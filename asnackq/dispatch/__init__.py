"""Delivering: many coroutines sending claimed jobs, one committer doing every transaction.

Rules of this wing:

* The committer owns every transaction and every held ticket; delivery coroutines only
  send, outside any transaction, and hand each result back.
* Leases are kept while a send lasts; a result is finished under the exact lease it was
  claimed with (the fence); a clock stepping back holds the run's clock, never ends it.
* The breaker pauses sends while the sink is away, without spending attempts.
* Imports: ``asnackq.store``, ``asnackq.wire``, ``asnackq.core``.
"""

from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.dispatch.summary import Summary

__all__ = ["BreakerPolicy", "Summary"]
