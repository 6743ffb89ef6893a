"""``asnackq lab --report DIR``: the run as one self-contained ``report.html``.

Rules of this module:

* The file opens from disk with no server and no network: plotly.js is inlined once, and
  each figure sits in the page as JSON (``<script type="application/json" class="figure">``)
  that a few lines of script hand to ``Plotly.newPlot``.
* Every number comes from the lab's result (``LabResult``, what ``--json`` writes): the figures
  draw ``result.series`` and ``result.evidence.latency_ms`` as they are, the tables show the same
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

from asnackq.lab.figures import CAPTIONS, figures
from asnackq.lab.result import LabResult, report_rows

__all__ = ["check_target", "render", "require", "write"]

INSTALL = "--report needs plotly: pip install 'asnackq[report]'"


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
    broken = len(result.evidence.violations) + len(result.liveness_failures)
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
        for line in [*result.evidence.violations[:100], *result.liveness_failures]
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
