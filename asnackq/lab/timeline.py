"""A lab run over time: the data behind the report's plots, from the run's evidence.

Rules of this module:

* Pure functions of what the lab collected (the workers' traces, the worker starts and
  kills, samples of the queue and of the sink's counters): no I/O, standard library only,
  so ``--json`` carries every series even without the plotting extra.
* Times are seconds since the run's start (``t0_ms``, on the traces' epoch-ms clock).
* The report draws these lists as they are: whatever it shows is here, so the report and
  the JSON agree by construction.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from asnackq.core import worker as w

__all__ = ["latency", "measured", "percentile", "series"]

# Bucket widths for "finished per interval": the smallest giving at most MAX_BUCKETS bars.
INTERVALS_MS = (100, 200, 250, 500, 1000, 2000, 5000, 10_000, 15_000, 30_000, 60_000)
MAX_BUCKETS = 120
HISTOGRAM_BINS = 40
STATUSES = w.STATUSES
SINK_COUNTERS = ("requests", "applied", "duplicates", "overloaded", "inflight")
LIMIT_FRESH_MS = 1000  # a worker's limit line older than this is not counted (killed, ended)
FINISHED = {"done": "done", "dead": "dead", "pending": "retried"}  # finish status -> series
# Recovery after a fault: the done rate over RECOVERY_WINDOW_MS, from the heal on, back at
# RECOVERED_SHARE of the rate over the BEFORE_MS before the fault began.
BEFORE_MS = 5000
RECOVERY_WINDOW_MS = 500
RECOVERED_SHARE = 0.8


def percentile(values: list[int], share: float) -> int | None:
    """The nearest-rank value at ``share`` (0..1) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def latency(samples_ms: list[int]) -> dict[str, Any]:
    """Claim-to-finish latency: percentiles and a histogram of equal-width bins."""
    top = max(samples_ms, default=0)
    width = round_up((top + 1) / HISTOGRAM_BINS)
    counts = [0] * (top // width + 1) if samples_ms else []
    for sample in samples_ms:
        counts[sample // width] += 1
    return {
        "p50": percentile(samples_ms, 0.5),
        "p90": percentile(samples_ms, 0.9),
        "p99": percentile(samples_ms, 0.99),
        "max": top if samples_ms else None,
        "samples": len(samples_ms),
        "histogram": {
            "bin_ms": width,
            "start_ms": [i * width for i in range(len(counts))],
            "count": counts,
        },
    }


def round_up(value: float) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``value`` (at least 1)."""
    if value <= 1:
        return 1
    power = int(10 ** math.floor(math.log10(value)))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= value)


def seconds(at_ms: int, t0_ms: int) -> float:
    return round((at_ms - t0_ms) / 1000, 3)


def interval_ms(span_ms: int) -> int:
    """The bar width for a run of ``span_ms``."""
    for width in INTERVALS_MS:
        if span_ms <= width * MAX_BUCKETS:
            return width
    return math.ceil(span_ms / MAX_BUCKETS / 60_000) * 60_000


def finished(traces: list[dict[str, Any]], t0_ms: int, end_ms: int) -> dict[str, Any]:
    """Committed finishes per interval, by what they did: done, dead, retried."""
    width = interval_ms(max(1, end_ms - t0_ms))
    count = max(1, math.ceil((end_ms - t0_ms) / width))
    bars: dict[str, list[int]] = {name: [0] * count for name in FINISHED.values()}
    for record in traces:
        if record["e"] == "finish" and record["status"] in FINISHED:
            index = min(count - 1, max(0, (record["at"] - t0_ms) // width))
            bars[FINISHED[record["status"]]][index] += 1
    return {"interval_s": width / 1000, "t_s": [i * width / 1000 for i in range(count)], **bars}


def columns(samples: list[dict[str, Any]], keys: tuple[str, ...], t0_ms: int) -> dict[str, Any]:
    """Samples (each with ``at`` in epoch ms) as one list per key, with ``t_s``."""
    table: dict[str, Any] = {"t_s": [seconds(s["at"], t0_ms) for s in samples]}
    table.update({key: [s.get(key, 0) for s in samples] for key in keys})
    return table


def limits(traces: list[dict[str, Any]], t0_ms: int) -> dict[str, Any]:
    """The workers' adaptive concurrency limits (``limit`` trace lines) summed: at each
    line, every worker's latest limit not older than ``LIMIT_FRESH_MS``."""
    latest: dict[str, tuple[int, int]] = {}  # owner -> (at, limit)
    table: dict[str, Any] = {"t_s": [], "limit": []}
    for record in sorted((r for r in traces if r["e"] == "limit"), key=lambda r: r["at"]):
        latest[record["owner"]] = (record["at"], record["limit"])
        fresh = [n for at, n in latest.values() if record["at"] - at <= LIMIT_FRESH_MS]
        table["t_s"].append(seconds(record["at"], t0_ms))
        table["limit"].append(sum(fresh))
    return table


def series(
    t0_ms: int,
    traces: list[dict[str, Any]],
    events: list[dict[str, Any]],
    statuses: list[dict[str, Any]],
    sink: list[dict[str, Any]],
    faults: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Every time series of a run: finishes per interval, worker starts and kills, jobs by
    status, the sink's counters and the scheduled faults (from ``at`` to ``until``)."""
    stamps = [r["at"] for r in traces] + [s["at"] for s in (*statuses, *sink, *events)]
    end_ms = max(stamps, default=t0_ms)
    return {
        "t0_ms": t0_ms,
        "seconds": seconds(end_ms, t0_ms),
        "finished": finished(traces, t0_ms, end_ms),
        "events": [
            {"t_s": seconds(e["at"], t0_ms), "e": e["e"], "owner": e["owner"]}
            for e in sorted(events, key=lambda e: e["at"])
        ],
        "statuses": columns(statuses, STATUSES, t0_ms),
        "sink": columns(sink, SINK_COUNTERS, t0_ms),
        "limits": limits(traces, t0_ms),
        "faults": [
            {
                "t_s": seconds(f["at"], t0_ms),
                "end_s": seconds(f["until"] or end_ms, t0_ms),
                "kind": f["kind"],
                "detail": f["detail"],
            }
            for f in faults
        ],
    }


def reading(samples: list[dict[str, Any]], key: str, at_ms: float) -> int:
    """The last sampled ``key`` at or before ``at_ms`` (0 before the first sample)."""
    value = 0
    for sample in samples:
        if sample["at"] > at_ms:
            break
        value = sample.get(key) or 0
    return value


def done_rate(statuses: list[dict[str, Any]], start_ms: float, end_ms: float) -> float:
    """Jobs done per second between two times, from the samples."""
    gained = reading(statuses, "done", end_ms) - reading(statuses, "done", start_ms)
    return gained * 1000 / max(1.0, end_ms - start_ms)


def recovery_ms(fault: dict[str, Any], statuses: list[dict[str, Any]]) -> int | None:
    """From the fault's heal to the end of the first window (starting at or after it) whose
    done rate is back at ``RECOVERED_SHARE`` of the rate before it; None if it never was
    (the jobs ran out first)."""
    t0 = statuses[0]["at"] if statuses else fault["at"]
    begin = max(t0, fault["at"] - BEFORE_MS)
    target = RECOVERED_SHARE * done_rate(statuses, begin, fault["at"])
    heal = fault["until"] or fault["at"]
    for sample in statuses:
        start = sample["at"] - RECOVERY_WINDOW_MS
        if start >= heal and done_rate(statuses, start, sample["at"]) >= target:
            return int(sample["at"] - heal)
    return None


def measured(
    faults: list[dict[str, Any]], statuses: list[dict[str, Any]], sink: list[dict[str, Any]]
) -> dict[str, Any]:
    """Each fault with its recovery time and the duplicates the sinks absorbed while it was
    on or recovering (from its start to its recovery, or the run's end); and the same by
    kind (``faults_by_kind``).  Where faults overlap, a duplicate counts for the one that
    began last, so no duplicate counts twice."""
    end = sink[-1]["at"] if sink else 0
    rows = []
    for fault in faults:
        took = recovery_ms(fault, statuses)
        until = end if took is None else (fault["until"] or fault["at"]) + took
        rows.append({**fault, "recovery_ms": took, "duplicates": 0, "_end": until})
    for before, after in itertools.pairwise(sink):
        gained = (after.get("duplicates") or 0) - (before.get("duplicates") or 0)
        on = [row for row in rows if row["at"] < after["at"] <= row["_end"]]
        if gained > 0 and on:
            max(on, key=lambda row: row["at"])["duplicates"] += gained
    for row in rows:
        del row["_end"]
    return {"faults": rows, "faults_by_kind": by_kind(rows)}


def by_kind(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per fault kind: how many, recovery p50 and max, how many never recovered, and the
    duplicates counted for them."""
    kinds: dict[str, Any] = {}
    for row in rows:
        kind = kinds.setdefault(row["kind"], {"count": 0, "duplicates": 0, "recovery": []})
        kind["count"] += 1
        kind["duplicates"] += row["duplicates"]
        kind["recovery"].append(row["recovery_ms"])
    for kind in kinds.values():
        times = [t for t in kind.pop("recovery") if t is not None]
        kind.update(
            recovery_p50_ms=percentile(times, 0.5),
            recovery_max_ms=max(times, default=None),
            unrecovered=kind["count"] - len(times),
        )
    return kinds
