"""``benchmarks/endpoints.py --scenario order`` at its ``--quick`` size: real ``asnackq work``
fleets, two SIGKILLed and started again, deliver to two ordered endpoints whose receivers
fail a fifth of the requests; every key's events are applied in enqueue order, each once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_bench_endpoints import run


@pytest.mark.process
@pytest.mark.timeout(600)  # (two worker processes, two kills and their leases: a busy machine)
def test_the_order_scenario_applies_every_keys_events_in_order_once(tmp_path: Path) -> None:
    done = run(tmp_path, "--scenario", "order", "--quick", "--json")
    assert done.returncode == 0, done.stderr
    [result] = json.loads(done.stdout.splitlines()[-1])["results"]
    assert result["target"] == "order keys applied in order, once"
    assert result["pass"] is True, result["detail"]
    assert "2 workers SIGKILLed" in result["detail"]
    assert "PASS" in done.stdout
    assert list(tmp_path.iterdir()) == []  # its files are gone
