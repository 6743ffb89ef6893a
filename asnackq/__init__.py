"""asnackq: at-least-once delivery with once-only effects.

The contract's sync functions and exceptions load with the package; the product's async
names (``AsyncQueue``, ``Dispatcher``, the senders, ...) load on first use, so the command
line stays light, and type checkers see them all (``py.typed``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asnackq.core import VERSION
from asnackq.core.worker import (
    BadAck,
    Conflict,
    Overloaded,
    Permanent,
    Retry,
    Retryable,
    Unavailable,
    claim,
    enqueue,
    finish,
    open_queue,
    redrive,
    retry_delay,
    run_file,
    run_once,
)

if TYPE_CHECKING:
    from asnackq.aio import AsyncQueue, Dispatcher
    from asnackq.dispatch.breaker import BreakerPolicy
    from asnackq.dispatch.summary import Summary
    from asnackq.store.outage import CommitUnknown, StoreUnavailable
    from asnackq.store.sqlite_aio import QueueBusy
    from asnackq.wire.send import AsyncHttpSender, HttpSender, Untrusted

__version__ = VERSION

# name -> the module it is loaded from on first use
LAZY = {
    "AsyncQueue": "asnackq.aio",
    "QueueBusy": "asnackq.store.sqlite_aio",
    "StoreUnavailable": "asnackq.store.outage",
    "CommitUnknown": "asnackq.store.outage",
    "Dispatcher": "asnackq.aio",
    "BreakerPolicy": "asnackq.dispatch.breaker",
    "Summary": "asnackq.dispatch.summary",
    "HttpSender": "asnackq.wire.send",
    "AsyncHttpSender": "asnackq.wire.send",
    "Untrusted": "asnackq.wire.send",
}

__all__ = [
    "AsyncHttpSender",
    "AsyncQueue",
    "BadAck",
    "BreakerPolicy",
    "CommitUnknown",
    "Conflict",
    "Dispatcher",
    "HttpSender",
    "Overloaded",
    "Permanent",
    "QueueBusy",
    "Retry",
    "Retryable",
    "StoreUnavailable",
    "Summary",
    "Unavailable",
    "Untrusted",
    "__version__",
    "claim",
    "enqueue",
    "finish",
    "open_queue",
    "redrive",
    "retry_delay",
    "run_file",
    "run_once",
]


def __getattr__(name: str) -> Any:
    """Load a product name on first use (PEP 562) and keep it in the package's namespace."""
    if name not in LAZY:
        raise AttributeError(f"module 'asnackq' has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
