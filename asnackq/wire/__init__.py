"""What crosses the network between workers and sinks, and what servers print.

Rules of this wing:

* The senders (``send``: stdlib and aiohttp) share one ACK judgement: an ACK counts only
  when it names the sent id with an effect status, read within its size and time bounds.
* With remote sinks allowed, a sender connects only to addresses the guard permits
  (``guard``: globally routable, or in an allowed network), resolving each host itself
  before each new connection.
* JSON from outside is read strictly in one place (``strict_json``): UTF-8, no duplicate
  keys, no NaN.
* Servers log one line per event, every byte a client chose escaped (``logs``); Prometheus
  text is rendered in ``metrics``.
* Imports: ``asnackq.core`` only.
"""

from asnackq.wire.guard import Refused
from asnackq.wire.send import AsyncHttpSender, HttpSender, Untrusted

__all__ = ["AsyncHttpSender", "HttpSender", "Refused", "Untrusted"]
