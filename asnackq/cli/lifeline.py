"""A child of the lab ends with it.

The lab (``asnackq.lab.procs``) names itself in ``ASNACKQ_PARENT_PID`` when it starts a sink
or a worker; the child asks the kernel for a SIGTERM when its parent ends (Linux's
``PR_SET_PDEATHSIG``), so that a lab SIGKILLed - or a test process that exits without its
``finally`` - leaves no sink or worker running.  The SIGTERM is the usual graceful stop.
A parent that is gone already ends the child at once.  Without the variable: nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["PARENT_ENV", "end_with_parent"]

PARENT_ENV = "ASNACKQ_PARENT_PID"
PR_SET_PDEATHSIG = 1


def end_with_parent() -> None:
    """Arrange to be SIGTERMed when the parent named in ``PARENT_ENV`` ends (and exit now if
    it has); the variable is not passed on to this process's own children."""
    value = os.environ.pop(PARENT_ENV, "")
    if not value.isdigit():
        return
    parent = int(value)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the prctl (``procs`` starts its children
        # directly, or through ``ip netns exec``, which runs them in its own process)
        raise SystemExit(f"asnackq: the process that started this one ({parent}) is gone")
