"""The ``asnackq`` command's entry point (and ``python -m asnackq``'s).

Loading the command line's modules takes a while (a fifth of a second); a Ctrl-C meanwhile
is one line and exit 130, as at any later moment, not a traceback.  This module imports
nothing of the command line until it runs.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> int:
    """Load the command line, then run it; ``interrupted`` if stopped while it loads."""
    try:
        from asnackq.cli import main as run
    except KeyboardInterrupt:  # (nothing was done yet)
        print("asnackq: interrupted", file=sys.stderr)
        return 130
    return run()
