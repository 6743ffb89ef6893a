"""The README's main command, end to end through its real entry point."""

from __future__ import annotations

import subprocess
import sys


def test_demo_recovers_a_killed_worker_with_every_effect_applied_once():
    run = subprocess.run([sys.executable, "-m", "asnackq", "demo"], capture_output=True,
                         text=True, timeout=120, check=False, env={"COLUMNS": "120",
                                                                   "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    lines = {line.split("│")[1].strip(): line.split("│")[2].strip()
             for line in run.stdout.splitlines() if line.count("│") == 3}
    assert lines["worker alpha exit code (killed after a send)"] == "9"
    assert lines["final states"] == "done 300"
    assert lines["every id's effect applied exactly once"] == "yes"
    assert lines["effects applied (inbox rows)"] == "300"
    assert int(lines["duplicates absorbed by the inbox"]) >= 1
    assert int(lines["jobs recovered by bravo (token > 1, done)"]) >= 1
    requests = int(lines["HTTP requests at the sink"])
    assert requests == 300 + int(lines["duplicates absorbed by the inbox"])


def test_usage_errors_exit_2():
    run = subprocess.run([sys.executable, "-m", "asnackq", "nonsense"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 2
