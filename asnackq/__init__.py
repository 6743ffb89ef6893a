"""asnackq: at-least-once delivery with once-only effects."""

from asnackq.core.worker import (
    BadAck,
    Conflict,
    Permanent,
    Retryable,
    claim,
    enqueue,
    finish,
    open_queue,
    redrive,
    retry_delay,
    run_file,
    run_once,
)

__version__ = "0.1.0"

__all__ = [
    "BadAck",
    "Conflict",
    "Permanent",
    "Retryable",
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
