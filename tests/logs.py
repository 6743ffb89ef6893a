"""A command's stderr with its state-change lines (``--log-format text``) set apart: what a
test of an error's one line looks at."""

from __future__ import annotations

import re

__all__ = ["EVENT_LINE", "problems"]

EVENT_LINE = re.compile(
    r"^asnackq (work|sink): (started|stopping|stopped|paused: |probing: |resumed: "
    r"|jobs ended dead|the queue's database is|the shared rate |concurrency cut"
    r"|the clock stepped back)"
)


def problems(stderr: str) -> str:
    """``stderr`` without the lines that tell a state change."""
    return "".join(line for line in stderr.splitlines(True) if not EVENT_LINE.match(line))
