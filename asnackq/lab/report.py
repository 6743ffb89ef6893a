"""``asnackq lab --report DIR``: the run as one self-contained ``report.html``.

Rules of this module:

* The file opens from disk with no server and no network: plotly.js is inlined once, and
  each figure sits in the page as JSON (``<script type="application/json" class="figure">``)
  that a few lines of script hand to ``Plotly.newPlot``.
* Every number comes from the lab's result (``LabResult``, what ``--json`` writes): the figures
  draw ``result.series`` and ``result.latency_ms`` as they are, the tables show the same
  rows as the terminal.  Nothing is measured or recomputed here.
* plotly is an optional extra (``asnackq[report]``); without it ``require`` fails with one
  line that says what to install, before the run starts.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from pathlib import Path
from typing import Any

from asnackq.lab.result import LabResult, report_rows

__all__ = ["FIGURES", "check_target", "figures", "render", "require", "write"]

INSTALL = "--report needs plotly: pip install 'asnackq[report]'"
FIGURES = ("throughput", "latency", "sink", "statuses")
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
}
PERCENTILE_DASH = {"p50": "solid", "p90": "dash", "p99": "dot"}
AXIS_S = {"title": {"text": "seconds since the workers started"}, "rangemode": "tozero"}


def require() -> Any:
    """The ``plotly`` package, or ``ValueError`` saying how to install it."""
    try:
        import plotly.graph_objects
        import plotly.offline
    except ImportError:
        raise ValueError(INSTALL) from None
    return plotly


def check_target(directory: Path) -> None:
    """Refuse a report directory that cannot be one, before the run starts (creating none)."""
    require()
    existing = next(path for path in (directory, *directory.absolute().parents) if path.exists())
    if not existing.is_dir():
        raise ValueError(f"--report {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--report {directory}: {existing} is not writable")
    if (directory / "report.html").is_dir():
        raise ValueError(f"--report {directory}: {directory / 'report.html'} is a directory")


# --- the figures (plotly's JSON figure format) --------------------------------------------


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


def figures(result: LabResult) -> dict[str, dict[str, Any]]:
    """The report's figures, by name (``FIGURES``), as plotly JSON figures."""
    series = result.series
    return {
        "throughput": throughput(series),
        "latency": latency(result.latency_ms),
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
    }


# --- the page -----------------------------------------------------------------------------


def embedded(figure: dict[str, Any]) -> str:
    """A figure as JSON that cannot close its ``<script>`` element."""
    text = json.dumps(figure, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def table(rows: list[tuple[str, object]], css: str) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(str(value))}</td></tr>"
        for key, value in rows
    )
    return f'<table class="{css}">{cells}</table>'


def invariants_table(result: LabResult) -> str:
    cells = "".join(
        f'<tr class="{row["verdict"]}"><th>{html.escape(row["name"])}</th>'
        f'<td>{html.escape(row["description"])}</td><td class="verdict">{row["verdict"]}</td>'
        f"<td>{row['violations']}</td></tr>"
        for row in result.invariants
    )
    return (
        '<table class="invariants"><tr><th>invariant</th><th>what it says</th>'
        f"<th>verdict</th><th>violations</th></tr>{cells}</table>"
    )


def verdict(result: LabResult) -> tuple[str, str]:
    broken = len(result.violations) + len(result.liveness_failures)
    if broken:
        return "bad", f"{broken} violations or liveness failures"
    return "ok", "every invariant holds"


def plots(result: LabResult, plotly: Any) -> str:
    parts = []
    for name, figure in figures(result).items():
        plotly.graph_objects.Figure(figure)  # checks every property's name and type
        parts.append(
            f'<figure><div class="plot" id="plot-{name}"></div>'
            f"<figcaption>{html.escape(CAPTIONS[name])}</figcaption></figure>"
            f'<script type="application/json" class="figure" data-plot="plot-{name}">'
            f"{embedded(figure)}</script>"
        )
    return "\n".join(parts)


def render(result: LabResult) -> str:
    """The whole page (plotly.js inlined)."""
    plotly = require()
    started = datetime.datetime.fromtimestamp(result.series["t0_ms"] / 1000, datetime.UTC)
    css, text = verdict(result)
    problems = "".join(
        f"<li>{html.escape(line)}</li>"
        for line in [*result.violations[:100], *result.liveness_failures]
    )
    config = [(key, "-" if value is None else value) for key, value in result.config.items()]
    return PAGE.format(
        started=started.isoformat(timespec="seconds"),
        css=css,
        verdict=html.escape(text),
        plots=plots(result, plotly),
        summary=table(report_rows(result), "summary"),
        invariants=invariants_table(result),
        config=table(config, "config"),
        problems=f"<h2>Violations</h2><ul>{problems}</ul>" if problems else "",
        plotly=plotly.offline.get_plotlyjs(),
        draw=DRAW,
    )


def write(result: LabResult, directory: Path) -> Path:
    """Write ``DIRECTORY/report.html``; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "report.html"
    path.write_text(render(result), encoding="utf-8")
    return path


DRAW = """
for (const node of document.querySelectorAll("script.figure")) {
  const figure = JSON.parse(node.textContent);
  Plotly.newPlot(node.dataset.plot, figure.data, figure.layout,
                 {responsive: true, displaylogo: false});
}
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>asnackq lab report</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px;
       color: #1d3557; padding: 0 1em; }}
h1 {{ margin-bottom: 0.2em; }} h2 {{ margin-top: 1.6em; }}
.verdict-line {{ font-size: 1.2em; font-weight: bold; padding: 0.4em 0.8em; border-radius: 4px; }}
.verdict-line.ok {{ background: #d8f3dc; }} .verdict-line.bad {{ background: #ffccd5; }}
figure {{ margin: 1em 0; border: 1px solid #e0e0e0; border-radius: 4px; }}
figcaption {{ padding: 0 1em 0.8em; color: #555; }}
table {{ border-collapse: collapse; margin: 0.5em 0; }}
th, td {{ border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }}
.summary td, .config td {{ text-align: right; font-variant-numeric: tabular-nums; }}
tr.broken {{ background: #ffccd5; }} tr.expected {{ background: #fff3bf; }}
</style></head>
<body>
<h1>asnackq lab report</h1>
<p>Run started {started} (UTC).</p>
<p class="verdict-line {css}">{verdict}</p>
<section id="plots">
{plots}
</section>
<section><h2>Summary</h2>{summary}</section>
<section><h2>Invariants</h2>{invariants}{problems}</section>
<section><h2>Configuration</h2>{config}</section>
<script>{plotly}</script>
<script>{draw}</script>
</body></html>
"""
