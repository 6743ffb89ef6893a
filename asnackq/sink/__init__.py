"""Receiving: an HTTP sink that applies each job's effect once, however often it arrives.

Rules of this wing:

* The inbox row and the effect commit in one transaction; the ACK leaves after COMMIT.
* Concurrent requests are group-committed, each decided on its own in arrival order
  (``asnackq.core.inbox``, ``inbox``): one set of inbox rules for every receiver, the
  sink included (``stock``: its store and its stock effect).
* A request the sink will not act on changes nothing and gets a JSON 4xx with its reason;
  a DB that cannot commit is a 503 until it can.
* Imports: ``asnackq.store``, ``asnackq.wire``, ``asnackq.core``.
* The aiohttp application and its serving are ``asnackq.http_sink``; this wing holds
  its parts, none of which imports aiohttp at import time: ``inbox`` (the group commit),
  ``stock`` (the sink's store and effect),
  ``capacity``, ``faults``, ``spans``, ``checks`` (signatures, secrets, the token header).
* ``receiver`` is the receiving library for any aiohttp application (``WebhookReceiver``,
  re-exported by ``asnackq.http_sink``): its handler imports aiohttp, and the command line
  imports it only when it serves.
"""
