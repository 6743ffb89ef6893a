"""``benchmarks/sink_throughput.py``: real servers measured in turn, each one's CPU per
request read from its own process (every thread), the client's not counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .benches import loaded, script

SCRIPT = script("sink_throughput")


bench = loaded("sink_throughput")

BURNER = """
import threading, time

def burn():
    while time.thread_time() < 0.3:
        pass

worker = threading.Thread(target=burn)
worker.start()
worker.join()
print("burnt", flush=True)
input()
"""


@pytest.mark.process
def test_a_process_cpu_counts_the_time_its_other_threads_used() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "burnt\n"
            assert 0.25 <= bench.process_cpu_s(child.pid) < 30  # (its main thread: far less)
        finally:
            child.kill()


@pytest.mark.process
def test_a_run_prints_each_servers_rate_and_cpu_per_request(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--concurrency", "1,4", "--requests", "400"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = run.stdout.splitlines()
    cpu_at = next(i for i, line in enumerate(lines) if line.startswith("CPU us per request"))
    assert lines[cpu_at + 1].split() == ["concurrency", "sink", "per-req", "sink/per-req"]
    for level, line in zip(("1", "4"), lines[cpu_at + 2 : cpu_at + 4], strict=True):
        cells = line.split()
        assert cells[0] == level
        assert float(cells[1]) > 0 and float(cells[2]) > 0  # each sink used CPU
        assert cells[3] != "-"  # (and so a ratio)
    rates = lines[lines.index(next(x for x in lines if x.startswith("concurrency"))) + 1]
    assert rates.split()[0] == "1" and float(rates.split()[2]) > 0  # the sink's rate
    assert list(tmp_path.iterdir()) == []  # its databases are gone with the run


@pytest.mark.process
def test_a_child_given_a_tree_imports_that_trees_asnackq_from_a_checkouts_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "tree"
    (tree / "asnackq").mkdir(parents=True)
    (tree / "asnackq" / "__init__.py").write_text("")
    (tree / "asnackq" / "__main__.py").write_text(
        "import sys\nprint('the tree listening on', sys.argv[1:], flush=True)\n"
    )
    monkeypatch.chdir(SCRIPT.parent.parent)  # a checkout's root: its own asnackq is there
    proc, last = bench.start([*bench.ASNACKQ, "sink"], str(tree))
    with proc:
        assert proc.wait(timeout=60) == 0
    assert last == "['sink']"  # the tree's module ran, not the checkout's sink


def test_a_ratio_skips_the_rounds_whose_divisor_read_zero() -> None:
    cpu = {"sink": {1: [300.0, 250.0, 320.0]}, "base": {1: [0.0, 125.0, 160.0]}}
    assert bench.ratio(cpu, "sink", "base", 1) == "2.00 (2.00-2.00)"
    assert bench.ratio({"sink": {1: [300.0]}, "base": {1: [0.0]}}, "sink", "base", 1).strip() == "-"
