"""``asnackq lab --report DIR`` from a real lab run: the HTML parses, every plot is there
and drawn from data, and every number in the report is the number in ``--json``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asnackq.lab import LabResult, report_rows

from .browser import screenshot, wait_for
from .page import Page
from .test_cli import asnackq, fails

# A whole lab runs in the module's fixture: on a busy machine, minutes.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    """One small lab with kills and faults, its ``--json`` and its ``--report``."""
    root = tmp_path_factory.mktemp("report")
    run = asnackq(
        "lab",
        "--jobs",
        "300",
        "--processes",
        "2",
        "--concurrency",
        "4",
        "--delay-ms",
        "50",
        "--fail-rate",
        "0.1",
        "--drop-rate",
        "0.1",
        "--kill-every",
        "1.0",
        "--max-attempts",
        "16",
        "--seed",
        "11",
        "--lease-ms",
        "800",
        "--send-timeout-s",
        "0.4",
        "--dir",
        root / "lab",
        "--json",
        root / "lab.json",
        "--report",
        root / "out",
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"report: {root / 'out' / 'report.html'}" in run.stdout
    result = json.loads((root / "lab.json").read_text())
    return result, root / "out" / "report.html"


PLOTS = ("throughput", "latency", "sink", "statuses")


def figures(page, names=PLOTS):
    found = {
        attrs["data-plot"]: json.loads(text)
        for attrs, text in page.scripts
        if attrs.get("class") == "figure"
    }
    assert set(found) == {f"plot-{n}" for n in names}
    assert set(found) <= page.ids  # each has its element to draw in
    return found


def traces(figure):
    return {trace["name"]: trace for trace in figure["data"]}


def lines_at(trace):
    """The x of each vertical line in a line trace (x, x, None per line)."""
    return trace["x"][::3]


def test_the_report_is_one_self_contained_page(lab_run):
    _, path = lab_run
    text = path.read_text(encoding="utf-8")
    page = Page(text)  # parses, every element closed
    assert page.references == []  # no src, no href: nothing to fetch
    inline = [text for attrs, text in page.scripts if not attrs]
    assert len(inline) == 2 and "Plotly" in inline[0] and len(inline[0]) > 1_000_000
    assert "Plotly.newPlot" in inline[1]
    for figure in figures(page).values():  # every plot has data to draw
        assert any(any(v for v in trace["y"] if v) for trace in figure["data"])


def test_every_plot_draws_the_numbers_of_the_json(lab_run):
    result, path = lab_run
    found = figures(Page(path.read_text(encoding="utf-8")))
    series = result["series"]
    throughput = traces(found["plot-throughput"])
    for name in ("done", "dead"):
        assert throughput[name]["x"] == series["finished"]["t_s"]
        assert throughput[name]["y"] == series["finished"][name]
    kills = [e for e in series["events"] if e["e"] == "kill"]
    starts = [e for e in series["events"] if e["e"] == "start"]
    assert len(kills) == result["kills"] >= 1 and len(starts) == result["workers_started"]
    assert lines_at(throughput["SIGKILL"]) == [e["t_s"] for e in kills]
    assert lines_at(throughput["worker start"]) == [e["t_s"] for e in starts]
    assert sum(throughput["done"]["y"]) <= result["statuses"]["done"]  # traced finishes

    latency = found["plot-latency"]
    bars = traces(latency)["jobs"]
    histogram = result["latency_ms"]["histogram"]
    assert (bars["x"], bars["y"]) == (histogram["start_ms"], histogram["count"])
    assert sum(bars["y"]) == result["latency_ms"]["samples"] > 0
    marks = {name.split()[0]: trace for name, trace in traces(latency).items() if name != "jobs"}
    for p in ("p50", "p90", "p99"):
        assert lines_at(marks[p]) == [result["latency_ms"][p]]
    assert result["latency_ms"]["p50"] <= result["latency_ms"]["p90"] <= result["latency_ms"]["p99"]

    for plot, table in (("plot-sink", "sink"), ("plot-statuses", "statuses")):
        for name, trace in traces(found[plot]).items():
            assert (trace["x"], trace["y"]) == (series[table]["t_s"], series[table][name])
    final = {name: values[-1] for name, values in series["statuses"].items() if name != "t_s"}
    assert final == {
        "pending": 0,
        "leased": 0,
        "done": result["statuses"].get("done", 0),
        "dead": result["statuses"].get("dead", 0),
    }
    assert series["sink"]["requests"][-1] == result["requests"]
    assert series["sink"]["duplicates"][-1] == result["duplicates"]
    assert series["sink"]["applied"][-1] == 300


@pytest.mark.process
def test_a_traced_run_shows_the_attempts_of_re_delivered_jobs(tmp_path):
    """``lab --spans``: every process's spans in one file; a re-delivered job's attempts and
    the sink's decisions are all in its one trace, begun by the lab's intake."""
    run = asnackq(
        *("lab", "--jobs", "60", "--processes", "1", "--concurrency", "8"),
        *("--kill-after-acks", "4", "--lease-ms", "1000", "--send-timeout-s", "0.5"),
        *("--dir", tmp_path / "lab", "--json", tmp_path / "lab.json"),
        *("--report", tmp_path / "out", "--spans", tmp_path / "spans.jsonl"),
        timeout=50,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    jobs = json.loads((tmp_path / "lab.json").read_text())["attempts"]
    assert 1 <= len(jobs) <= 6 and jobs == sorted(jobs, key=lambda job: job["id"])
    for job in jobs:  # the killed worker's attempt never ended: only the sink saw it
        assert len(job["traces"]) == 1
        assert [d["decision"] for d in job["sink"]] == ["applied", "duplicate"]
        assert [d["token"] for d in job["sink"]] == [1, 2]
        assert [(a["token"], a["result"]) for a in job["attempts"]] == [(2, "done")]
    page = Page((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    found = traces(figures(page, (*PLOTS, "attempts"))["plot-attempts"])
    assert found["attempt: done"]["y"] == [f"{job['id']} t2" for job in jobs]
    assert found["sink: applied"]["y"] == [f"{job['id']} t1" for job in jobs]
    assert found["sink: duplicate"]["y"] == [f"{job['id']} t2" for job in jobs]


def test_the_tables_show_the_numbers_of_the_json(lab_run):
    result, path = lab_run
    tables = Page(path.read_text(encoding="utf-8")).tables
    assert tables["summary"] == [
        [key, str(value)] for key, value in report_rows(LabResult.from_dict(result))
    ]
    assert tables["invariants"][1:] == [
        [row["name"], row["description"], row["verdict"], str(row["violations"])]
        for row in result["invariants"]
    ]
    assert {row[2] for row in tables["invariants"][1:]} == {"holds"}
    assert tables["config"] == [
        [key, "-" if value is None else str(value)] for key, value in result["config"].items()
    ]


@pytest.mark.process
def test_without_plotly_report_fails_at_once_with_what_to_install(tmp_path):
    blocked = (
        "import sys; sys.modules['plotly'] = None; from asnackq.cli import main; "
        f"sys.exit(main(['lab', '--dir', {str(tmp_path / 'lab')!r}, '--report', "
        f"{str(tmp_path / 'out')!r}]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == "asnackq lab: --report needs plotly: pip install 'asnackq[report]'\n"
    assert not (tmp_path / "lab").exists() and not (tmp_path / "out").exists()


@pytest.mark.process
def test_a_report_target_that_cannot_be_one_is_refused_before_the_run(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    (tmp_path / "out" / "report.html").mkdir(parents=True)
    for target, why in (
        (taken, "is not a directory"),
        (taken / "below", "is not a directory"),
        (tmp_path / "out", "report.html is a directory"),
    ):
        said = fails("lab", "--dir", tmp_path / "lab", "--report", target)
        assert why in said and said.count("\n") == 1, said
    assert not (tmp_path / "lab").exists() and taken.read_text() == "not a directory"


def test_the_report_draws_every_plot_from_disk_in_a_browser(lab_run, browser, tmp_path):
    _, path = lab_run
    browser.get(path.as_uri())
    drawn = """return [...document.querySelectorAll("div.plot")].map((plot) => [plot.id,
        plot.querySelectorAll(".main-svg").length,
        plot.querySelectorAll(".bars path, .scatterlayer path.js-line").length])"""

    def probe():
        plots = browser.execute_script(drawn)
        return len(plots) == 4 and all(svgs and marks for _, svgs, marks in plots), plots

    wait_for(probe, what="the report's plots")
    assert (
        browser.execute_script(  # nothing came from anywhere else
            "return performance.getEntriesByType('resource').map((r) => r.name)"
        )
        == []
    )
    png = screenshot(browser, tmp_path, "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000
