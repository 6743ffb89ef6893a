"""A child of the lab ends with it.

The lab (``asnackq.lab.procs``) hands each sink and worker it starts the read end of a pipe
whose write end only the lab's process holds (``ASNACKQ_LIFELINE_FD`` names it).  The child
waits on it in a thread: the read returns when that process ends, however it ends (a
SIGKILL, a test process that exits without its ``finally``), and the child then sends itself
SIGTERM, its usual graceful stop.  It is the process that matters, not the thread that
started the child.  Without the variable, or when it names no pipe: nothing.
"""

from __future__ import annotations

import os
import signal
import stat
import threading

__all__ = ["LIFELINE_ENV", "end_with_parent"]

LIFELINE_ENV = "ASNACKQ_LIFELINE_FD"


def end_with_parent() -> None:
    """Watch the lifeline named in ``LIFELINE_ENV`` (not passed on to this process's own
    children): when its writer is gone, SIGTERM this process."""
    value = os.environ.pop(LIFELINE_ENV, "")
    if not (value.isascii() and value.isdigit()):
        return
    fd = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except (OSError, OverflowError):  # no such descriptor here (or none could be)
        return
    threading.Thread(target=watch, args=(fd,), name="asnackq-lifeline", daemon=True).start()


def watch(fd: int) -> None:
    """Block until the pipe's writer is gone (end of file), then SIGTERM this process."""
    try:
        while os.read(fd, 512):
            pass  # (nothing is ever written: a write is no reason to stop)
    except OSError:
        return
    os.kill(os.getpid(), signal.SIGTERM)
