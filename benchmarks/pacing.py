"""Pacing to a sink of limited capacity: --concurrency auto against a fixed concurrency.

    python benchmarks/pacing.py [--jobs 4000] [--processes 3] [--inflight 8] [--delay-ms 20]
                                [--fixed 64] [--json FILE]

Two lab runs back to back (``asnackq.lab.run_lab``: a real sink process, real worker
processes, every invariant checked from the evidence), against a sink of capacity
C = inflight / delay (8 in flight x 20 ms: 400 requests a second; past it, 429 with
Retry-After):

1. every worker with ``--concurrency auto``;
2. every worker with ``--concurrency FIXED``.

Printed for each: goodput (jobs done a second) after the first 2 s of finishes and its share
of C, the share of requests answered 429, the claim-to-finish p50 and p99 (and p99 over the
sink's delay), and the verdicts; then the fixed run's 429 share and p99 over the auto run's.
Targets (auto): goodput >= 0.9 x C after the first 2 s, < 2 % of requests answered 429,
p99 <= 3 x the delay; every invariant and liveness verdict holds, no job dead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from asnackq.lab import LabConfig, run_lab

WARM_UP_S = 2.0  # finishes before this (from the first) are left out of the goodput


def goodput(series: dict[str, Any]) -> float:
    """Jobs done a second from WARM_UP_S after the first done interval to the last one."""
    finished = series["finished"]
    width, done = finished["interval_s"], finished["done"]
    busy = [i for i, n in enumerate(done) if n]
    if not busy:
        return 0.0
    first = busy[0] + round(WARM_UP_S / width)
    last = busy[-1]  # (the last interval may be partial: left out)
    if last <= first:
        return 0.0
    return sum(done[first:last]) / ((last - first) * width)


def figures(config: LabConfig) -> dict[str, Any]:
    """One lab run, and what it measured."""
    with tempfile.TemporaryDirectory(prefix="asnackq-pacing-") as tmp:
        config.directory = Path(tmp) / "lab"
        result = run_lab(config, Console(stderr=True))
    capacity = config.sink_max_inflight / (config.delay_ms / 1000)  # type: ignore[operator]
    rate = goodput(result.series)
    return {
        "concurrency": config.concurrency,
        "goodput_per_s": round(rate, 1),
        "goodput_share_of_capacity": round(rate / capacity, 3),
        "requests": result.requests,
        "answered_429": result.sink_overloaded,
        "share_429": round(result.sink_overloaded / max(1, result.requests), 4),
        "p50_ms": result.evidence.latency_ms["p50"],
        "p99_ms": result.evidence.latency_ms["p99"],
        "p99_over_delay": round((result.evidence.latency_ms["p99"] or 0) / config.delay_ms, 1),
        "dead": result.evidence.statuses.get("dead", 0),
        "violations": len(result.evidence.violations),
        "liveness_failures": len(result.liveness_failures),
        "seconds": result.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--delay-ms", type=int, default=20)
    parser.add_argument("--fixed", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = {}
    for concurrency in ("auto", args.fixed):
        config = LabConfig(
            jobs=args.jobs,
            processes=args.processes,
            concurrency=concurrency,
            delay_ms=args.delay_ms,
            sink_max_inflight=args.inflight,
            lease_ms=5000,
            timeout_s=600,
        )
        runs[str(concurrency)] = figures(config)
        print(json.dumps(runs[str(concurrency)]), flush=True)
    auto, fixed = runs["auto"], runs[str(args.fixed)]
    capacity = args.inflight / (args.delay_ms / 1000)
    print(f"sink capacity C = {args.inflight} in flight / {args.delay_ms} ms = {capacity:g}/s")
    for name, run in runs.items():
        print(
            f"{name:>5}: goodput {run['goodput_per_s']}/s = {run['goodput_share_of_capacity']} C"
            f"  429s {run['share_429']:.2%}  p50/p99 {run['p50_ms']}/{run['p99_ms']} ms"
            f" (p99 {run['p99_over_delay']} x delay)  dead {run['dead']}"
            f"  violations {run['violations']}  liveness failures {run['liveness_failures']}"
        )
    print(
        f"fixed {args.fixed} over auto: 429 share x"
        f"{fixed['share_429'] / max(auto['share_429'], 1e-9):.1f}, p99 x"
        f"{(fixed['p99_ms'] or 0) / max(auto['p99_ms'] or 1, 1):.1f}, goodput x"
        f"{fixed['goodput_per_s'] / max(auto['goodput_per_s'], 1e-9):.2f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
