"""Pacing to a sink of limited capacity: --concurrency auto against a fixed concurrency.

    python benchmarks/pacing.py [--jobs 4000] [--processes 3] [--inflight 8] [--delay-ms 20]
                                [--fixed 64] [--pg-local] [--json FILE]

Two lab runs back to back (``asnackq.lab.run_lab``: a real sink process, real worker
processes, every invariant checked from the evidence), against a sink of capacity
C = inflight / delay (8 in flight x 20 ms: 400 requests a second; past it, 429 with
Retry-After):

1. every worker with ``--concurrency auto``;
2. every worker with ``--concurrency FIXED``;

and, first, the sink's own ceiling on this machine: one process holding exactly ``inflight``
requests in flight (each sent again as soon as it is answered: never a 429), with no queue at
all - what a client that knew C and had nothing else to do would get from the same sink.

Printed for each: goodput (jobs done a second) after the first 2 s of finishes and its share
of C, the share of requests answered 429, the claim-to-finish p50 and p99 (and p99 over the
sink's delay), and the verdicts; then the fixed run's 429 share and p99 over the auto run's.
Targets (auto): goodput >= 0.9 x C after the first 2 s, < 2 % of requests answered 429,
p99 <= 3 x the delay; every invariant and liveness verdict holds, no job dead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from asnackq.lab import LabConfig, run_lab
from asnackq.wire.send import AsyncHttpSender

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


def ceiling(inflight: int, delay_ms: int, seconds: float = 6.0) -> float:
    """Requests answered 200 a second by a real sink to one process holding exactly
    ``inflight`` in flight, after WARM_UP_S (no queue, no 429 possible)."""
    with tempfile.TemporaryDirectory(prefix="asnackq-ceiling-") as tmp:
        argv = [sys.executable, "-m", "asnackq", "sink", "--db", f"{tmp}/sink.db", "--port", "0"]
        argv += ["--delay-ms", str(delay_ms), "--max-inflight", str(inflight)]
        sink = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert sink.stdout is not None
            while not (found := re.search(r"http://127\.0\.0\.1:\d+", sink.stdout.readline())):
                pass
            return asyncio.run(hold(found.group(0) + "/events", inflight, seconds))
        finally:
            sink.terminate()
            sink.wait(10)


async def hold(url: str, inflight: int, seconds: float) -> float:
    """``inflight`` loops, each sending its next event as soon as the last is answered."""
    counted, began = [0], time.monotonic()
    ends = began + seconds

    async def loop(i: int, send: AsyncHttpSender) -> None:
        n = 0
        while time.monotonic() < ends:
            n += 1
            await send({"id": f"c{i}-{n}", "qty": 1}, 1)  # (raises on anything but an ACK)
            if time.monotonic() - began >= WARM_UP_S:
                counted[0] += 1

    async with AsyncHttpSender(url) as send:
        await asyncio.gather(*(loop(i, send) for i in range(inflight)))
    return counted[0] / (time.monotonic() - began - WARM_UP_S)


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
    parser.add_argument("--pg-local", action="store_true", help="the queue on a local PostgreSQL")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    capacity = args.inflight / (args.delay_ms / 1000)
    reference = ceiling(args.inflight, args.delay_ms)
    print(json.dumps({"ceiling_per_s": round(reference, 1)}), flush=True)
    runs: dict[str, Any] = {"ceiling": {"goodput_per_s": round(reference, 1)}}
    for concurrency in ("auto", args.fixed):
        config = LabConfig(
            jobs=args.jobs,
            processes=args.processes,
            concurrency=concurrency,
            delay_ms=args.delay_ms,
            sink_max_inflight=args.inflight,
            lease_ms=5000,
            timeout_s=600,
            pg_local=args.pg_local,
        )
        runs[str(concurrency)] = figures(config)
        print(json.dumps(runs[str(concurrency)]), flush=True)
    auto, fixed = runs["auto"], runs[str(args.fixed)]
    print(f"sink capacity C = {args.inflight} in flight / {args.delay_ms} ms = {capacity:g}/s")
    share = auto["goodput_per_s"] / reference
    print(
        f"ceiling: {reference:.1f}/s = {reference / capacity:.3f} C (one process, exactly"
        f" {args.inflight} in flight, no queue); auto reaches {share:.3f} of it"
    )
    for name, run in (item for item in runs.items() if item[0] != "ceiling"):
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
