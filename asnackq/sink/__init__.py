"""Receiving: an HTTP sink that applies each job's effect once, however often it arrives.

Rules of this wing:

* The inbox row and the effect commit in one transaction; the ACK leaves after COMMIT.
* Concurrent requests are group-committed, each decided on its own in arrival order
  (``asnackq.core.inbox``).
* A request the sink will not act on changes nothing and gets a JSON 4xx with its reason;
  a DB that cannot commit is a 503 until it can.
* Imports: ``asnackq.store``, ``asnackq.wire``, ``asnackq.core``.
* The names below load on first use (PEP 562): a command that only checks a sink's options
  (``asnackq.sink.faults``, ``asnackq.sink.capacity``) does not import aiohttp.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asnackq.sink.app import SinkConfig, make_app
    from asnackq.sink.server import serve

LAZY = {
    "SinkConfig": "asnackq.sink.app",
    "make_app": "asnackq.sink.app",
    "serve": "asnackq.sink.server",
}

__all__ = ["SinkConfig", "make_app", "serve"]


def __getattr__(name: str) -> Any:
    """Load a name on first use and keep it in the package's namespace."""
    if name not in LAZY:
        raise AttributeError(f"module 'asnackq.sink' has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY[name]), name)
    globals()[name] = value
    return value
