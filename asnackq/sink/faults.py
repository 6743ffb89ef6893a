"""The faults a sink injects for experiments: one rule for the sink, the lab and the
command line (which parses with these ranges, so a bad value is a usage error there).

A fault's rate is a probability in ``PROBABILITY`` (``--fail-rate``: 503 before any change,
``--drop-rate``: commit, then drop the connection); the delay before each answer is an
int of milliseconds in ``DELAY_MS``.
"""

from __future__ import annotations

from asnackq.core.worker import check_int
from asnackq.wire.send import check_number

__all__ = ["DELAY_MS", "PROBABILITY", "check"]

PROBABILITY = (0, 1)
DELAY_MS = (0, 60_000)


def check(fail_rate: object, drop_rate: object, delay_ms: object) -> None:
    """``ValueError`` unless both rates are probabilities in ``PROBABILITY`` and the delay an int in
    ``DELAY_MS`` (never a bool, NaN or infinity)."""
    check_number(fail_rate, "fail_rate", *PROBABILITY)
    check_number(drop_rate, "drop_rate", *PROBABILITY)
    check_int(delay_ms, "delay_ms", *DELAY_MS)
