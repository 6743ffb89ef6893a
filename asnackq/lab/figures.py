"""The lab report's figures: plotly JSON figures drawn from a ``LabResult`` as it is (nothing
is measured or recomputed here), one per name in ``FIGURES`` (``pacing`` only for a run
that paced: ``--concurrency auto`` or a sink with a capacity)."""

from __future__ import annotations

from typing import Any

from asnackq.lab.result import LabResult

__all__ = ["CAPTIONS", "FIGURES", "figures"]

FIGURES = ("throughput", "latency", "sink", "statuses", "pacing", "attempts")
COLORS = {
    "done": "#2a9d8f",
    "dead": "#e63946",
    "retried": "#e9c46a",
    "kill": "#d62828",
    "start": "#457b9d",
    "pending": "#a8dadc",
    "leased": "#f4a261",
    "requests": "#457b9d",
    "applied": "#2a9d8f",
    "duplicates": "#e76f51",
    "pg-restart": "#6a4c93",
    "pg-kill-backends": "#ff595e",
    "partition": "#1982c4",
    "limit": "#6a4c93",
    "inflight": "#2a9d8f",
    "retry": "#e9c46a",
    "stale": "#6c757d",
    "lost": "#6c757d",
    "abandoned": "#adb5bd",
    "unanswered": "#adb5bd",
    "duplicate": "#e76f51",
    "conflict": "#e63946",
}
CAPTIONS = {
    "throughput": "Done and dead finishes the workers committed per interval (from their "
    "traces), retries as a line; every worker start and SIGKILL is a vertical line, every "
    "scheduled fault a band from its start to its heal. Jobs a "
    "claim quarantined (out of attempts or past their deadline) show under jobs by status.",
    "latency": "From each job's claim to its accepted finish, for every finish in the "
    "traces, with p50, p90 and p99 marked.",
    "sink": "The sink's counters, sampled during the run: HTTP requests, effects applied "
    "(new inbox rows) and duplicates its inbox absorbed.",
    "statuses": "The queue's jobs by status, sampled during the run (stacked).",
    "pacing": "Sends in flight: the workers' adaptive concurrency limits summed (with "
    "--concurrency auto; from their traces) and the requests in the sink's handlers "
    "(sampled).",
    "attempts": "A few jobs delivered more than once, from the run's spans (lab --spans): "
    "each delivery attempt from its start to its result, by owner and fencing token, and "
    "what the sink decided for each token it saw. A SIGKILLed worker's attempt has no span "
    "(it never ended); its request still shows at the sink.",
}
PERCENTILE_DASH = {"p50": "solid", "p90": "dash", "p99": "dot"}
AXIS_S = {"title": {"text": "seconds since the workers started"}, "rangemode": "tozero"}


def layout(title: str, xaxis: dict[str, Any], yaxis: str, **more: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "xaxis": xaxis,
        "yaxis": {"title": {"text": yaxis}},
        "legend": {"orientation": "h", "y": -0.25},
        "margin": {"t": 50, "r": 20},
        "height": 380,
        **more,
    }


def vertical(
    name: str, xs: list[float], top: float, labels: list[str], color: str, dash: str
) -> dict[str, Any]:
    """One trace of vertical lines at ``xs`` (``None`` breaks the line between them)."""
    x: list[float | None] = []
    y: list[float | None] = []
    text: list[str | None] = []
    for at, label in zip(xs, labels, strict=True):
        x += [at, at, None]
        y += [0, top, None]
        text += [label, label, None]
    return {
        "type": "scatter",
        "mode": "lines",
        "name": name,
        "x": x,
        "y": y,
        "text": text,
        "hovertemplate": "%{text} at %{x:.3f} s<extra></extra>",
        "line": {"color": color, "dash": dash, "width": 1.5},
    }


def throughput(series: dict[str, Any]) -> dict[str, Any]:
    """Jobs finished per interval (done, dead), retries, and every worker start and kill."""
    bars = series["finished"]
    width = bars["interval_s"]
    data: list[dict[str, Any]] = [
        {
            "type": "bar",
            "name": name,
            "x": bars["t_s"],
            "y": bars[name],
            "width": width,
            "offset": 0,
            "marker": {"color": COLORS[name]},
        }
        for name in ("done", "dead")
    ]
    data.append(
        {
            "type": "scatter",
            "mode": "lines",
            "name": "retried",
            "x": bars["t_s"],
            "y": bars["retried"],
            "line": {"color": COLORS["retried"], "shape": "hv"},
        }
    )
    top = max(
        [1, *(d + x for d, x in zip(bars["done"], bars["dead"], strict=True)), *bars["retried"]]
    )
    for kind, name, dash in (("kill", "SIGKILL", "dash"), ("start", "worker start", "dot")):
        events = [e for e in series["events"] if e["e"] == kind]
        data.append(
            vertical(
                name,
                [e["t_s"] for e in events],
                top,
                [f"{name} {e['owner']}" for e in events],
                COLORS[kind],
                dash,
            )
        )
    return {
        "data": data,
        "layout": layout(
            f"Jobs finished per {width:g} s",
            AXIS_S,
            "jobs",
            barmode="stack",
            bargap=0,
            shapes=kill_marks({**series, "events": []}),  # the faults' bands
        ),
    }


def latency(figures: dict[str, Any]) -> dict[str, Any]:
    """The claim-to-finish latency histogram with p50, p90 and p99 marked."""
    histogram = figures["histogram"]
    data: list[dict[str, Any]] = [
        {
            "type": "bar",
            "name": "jobs",
            "x": histogram["start_ms"],
            "y": histogram["count"],
            "width": histogram["bin_ms"],
            "offset": 0,
            "marker": {"color": COLORS["done"]},
        }
    ]
    top = max([1, *histogram["count"]])
    for name, dash in PERCENTILE_DASH.items():
        if figures[name] is not None:
            data.append(
                vertical(
                    f"{name} {figures[name]} ms", [figures[name]], top, [name], "#1d3557", dash
                )
            )
    axis = {"title": {"text": "claim to finish (ms)"}, "rangemode": "tozero"}
    empty = (
        []
        if figures["samples"]
        else [
            {
                "text": "no finish was traced",
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
            }
        ]
    )
    return {
        "data": data,
        "layout": layout(
            f"Claim-to-finish latency ({figures['samples']} finishes)",
            axis,
            "jobs",
            bargap=0,
            annotations=empty,
        ),
    }


def kill_marks(series: dict[str, Any]) -> list[dict[str, Any]]:
    """Every SIGKILL as a thin vertical line across a time plot, every scheduled fault as
    a band from its start to its heal (an instant one: a thin band), labelled."""
    kills = [
        mark("line", e["t_s"], e["t_s"], line={"color": COLORS["kill"], "width": 1, "dash": "dash"})
        for e in series["events"]
        if e["e"] == "kill"
    ]
    return kills + [
        mark(
            "rect",
            f["t_s"],
            max(f["end_s"], f["t_s"] + 0.05),
            fillcolor=COLORS[f["kind"]],
            opacity=0.18,
            line={"width": 0},
            label={"text": f"{f['kind']} {f['detail']}", "textposition": "top left"},
        )
        for f in series.get("faults", [])
    ]


def mark(kind: str, x0: float, x1: float, **style: Any) -> dict[str, Any]:
    """A shape across the plot's height from ``x0`` to ``x1`` seconds."""
    return {
        "type": kind,
        "xref": "x",
        "yref": "paper",
        "x0": x0,
        "x1": x1,
        "y0": 0,
        "y1": 1,
        **style,
    }


def lines(
    series: dict[str, Any],
    table: str,
    names: tuple[str, ...],
    title: str,
    yaxis: str,
    stacked: bool = False,
) -> dict[str, Any]:
    columns = series[table]
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": name,
            "x": columns["t_s"],
            "y": columns[name],
            "line": {"color": COLORS[name]},
            **({"stackgroup": "jobs"} if stacked else {}),
        }
        for name in names
    ]
    return {"data": data, "layout": layout(title, AXIS_S, yaxis, shapes=kill_marks(series))}


def attempts(timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """Each re-delivered job's attempts as bars in time, and the sink's decisions as marks."""
    rows: dict[str, list[dict[str, Any]]] = {}
    marks: dict[str, dict[str, list[Any]]] = {}
    for job in timelines:
        for a in job["attempts"]:
            row = f"{job['id']} t{a['token']}"
            rows.setdefault(a["result"] or "open", []).append(
                {
                    "y": row,
                    "base": a["start_ms"],
                    "x": a["end_ms"] - a["start_ms"],
                    "who": a["owner"],
                }
            )
        for d in job["sink"]:
            mark = marks.setdefault(d["decision"] or "?", {"x": [], "y": []})
            mark["x"].append(d["at_ms"])
            mark["y"].append(f"{job['id']} t{d['token']}")
    bars = [
        {
            "type": "bar",
            "orientation": "h",
            "name": f"attempt: {result}",
            "y": [b["y"] for b in bars],
            "x": [b["x"] for b in bars],
            "base": [b["base"] for b in bars],
            "text": [b["who"] for b in bars],
            "marker": {"color": COLORS.get(result, "#999999")},
        }
        for result, bars in rows.items()
    ]
    points = [
        {
            "type": "scatter",
            "mode": "markers",
            "name": f"sink: {decision}",
            **xy,
            "marker": {"symbol": "diamond", "size": 10, "color": COLORS.get(decision, "#000000")},
        }
        for decision, xy in marks.items()
    ]
    axis = {"title": {"text": "ms since the job's first attempt"}, "rangemode": "tozero"}
    title = "Re-delivered jobs: attempts and the sink's decisions"
    return {"data": bars + points, "layout": layout(title, axis, "job, fencing token")}


def figures(result: LabResult) -> dict[str, dict[str, Any]]:
    """The report's figures, by name (``FIGURES``), as plotly JSON figures."""
    series = result.series
    config = result.config
    paced = config.get("concurrency") == "auto" or any(
        config.get(key) is not None for key in ("sink_max_inflight", "sink_max_rate")
    )
    drawn = {
        "throughput": throughput(series),
        "latency": latency(result.evidence.latency_ms),
        "sink": lines(
            series,
            "sink",
            ("requests", "applied", "duplicates"),
            "Sink: requests, effects applied, duplicates absorbed (SIGKILLs dashed)",
            "count since start",
        ),
        "statuses": lines(
            series,
            "statuses",
            ("done", "dead", "leased", "pending"),
            "Jobs by status (SIGKILLs dashed)",
            "jobs",
            stacked=True,
        ),
        "pacing": pacing(series),
    }
    if not paced:
        del drawn["pacing"]
    if result.attempts:  # a traced run's
        drawn["attempts"] = attempts(result.attempts)
    return drawn


def pacing(series: dict[str, Any]) -> dict[str, Any]:
    """The workers' concurrency limit (summed) and the sink's in-flight requests."""
    limits = series.get("limits", {"t_s": [], "limit": []})
    sink = series["sink"]
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "line": {"color": COLORS[name], "shape": "hv"},
            "name": title,
            "x": table["t_s"],
            "y": table.get(name, []),
        }
        for name, title, table in (
            ("limit", "workers' concurrency limit (sum)", limits),
            ("inflight", "sink: requests in flight", sink),
        )
    ]
    title = "Sends in flight: the adaptive limit and the sink's load (SIGKILLs dashed)"
    return {"data": data, "layout": layout(title, AXIS_S, "requests", shapes=kill_marks(series))}
