"""``benchmarks/busy_loop.py`` at a small size on SQLite: a Dispatcher alone and beside
coroutines that keep its event loop running Python delivers every job either way (each
child checks that it delivered them all), and the script leaves no file behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "busy_loop.py"


@pytest.mark.process
@pytest.mark.timeout(300)  # (four child processes: on a busy machine, a minute)
def test_the_busy_loop_benchmark_delivers_every_job_alone_and_busy(tmp_path: Path) -> None:
    args = ["--store", "sqlite", "--jobs", "300", "--rounds", "1", "--busy", "2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--work-us", "20"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"round 1 sqlite alone this: +\d+ jobs/s", done.stdout)
    assert re.search(r"round 1 sqlite  busy this: +\d+ jobs/s", done.stdout)
    assert re.search(r"sqlite this: alone +\d+ busy +\d+ jobs/s, busy / alone \d", done.stdout)
    assert list(tmp_path.iterdir()) == []
