"""``benchmarks/endpoints.py`` runs: its ``--quick`` sizes, each scenario, one JSON line with a
target per measured ratio (the figures themselves are not judged here: never speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "endpoints.py"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.process
@pytest.mark.timeout(300)  # (a benchmark's every scenario: on a busy machine, minutes)
def test_the_endpoints_benchmark_runs_each_scenario_quickly(tmp_path: Path) -> None:
    done = run(tmp_path, "--quick", "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.splitlines()[-1])
    targets = {r["target"] for r in figures["results"]}
    assert targets == {
        "noisy goodput",
        "noisy p99",
        "noisy bad attempts/delivery (most)",
        "fairness B p99",
        "scale deliveries/s",
    }
    for r in figures["results"]:
        assert r["ratio"] > 0 and r["pass"] in (True, False)
        assert ("PASS" if r["pass"] else "FAIL") in done.stdout
    assert list(tmp_path.iterdir()) == []  # its files are gone


@pytest.mark.process
def test_an_unknown_scenario_is_one_clear_line(tmp_path: Path) -> None:
    done = run(tmp_path, "--scenario", "nope")
    assert done.returncode == 2
    assert done.stderr.strip() == "endpoints.py: unknown scenario ['nope']"
    assert list(tmp_path.iterdir()) == []
