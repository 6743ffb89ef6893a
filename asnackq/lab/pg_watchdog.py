"""Run as a script next to a throwaway PostgreSQL server: when the process that made the server
ends, however it ends, stop the server and remove its directory.

    python pg_watchdog.py ROOT PG_CTL_ARGV_JSON

It reads its standard input, a pipe whose only writer is that process, until end of file
(an exit, a SIGKILL), then runs ``PG_CTL_ARGV + [-D ROOT/data -m immediate -w stop]`` and
removes ``ROOT``.  It runs in a session of its own, so a signal to the process group it was
started from does not reach it.  Standard library only, and no import of the package: it is
started by path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def main(root: str, pg_ctl: str) -> None:
    sys.stdin.buffer.read()  # until the maker's end of the pipe is closed
    data = Path(root) / "data"
    if (data / "postmaster.pid").exists():
        subprocess.run(
            [*json.loads(pg_ctl), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=120,
            check=False,
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
