"""The dashboard in a real browser (headless Chromium): the page follows a run, refreshed
every second without reloading, to the final counts."""

from __future__ import annotations

import json

from asnackq.lab.procs import sink_process

from .browser import CSS, ID, screenshot, wait_for
from .test_cli import ok
from .test_dashboard import dashboard


def shows(driver, expected):
    """Wait until every ``data-field`` in ``expected`` shows its text."""

    def probe():
        seen = {name: driver.find_element(CSS, f'[data-field="{name}"]').text for name in expected}
        return seen == expected, seen

    return wait_for(probe, what=f"the dashboard ({expected})")


def number(driver, name):
    text = driver.find_element(CSS, f'[data-field="{name}"]').text
    return float(text.replace(",", ""))


def test_the_dashboard_follows_a_run(browser, tmp_path):
    queue, sink_db = tmp_path / "queue.db", tmp_path / "sink.db"
    ok("init", queue)
    jobs = "".join(json.dumps({"id": f"snack-{i}", "qty": i % 5 + 1}) + "\n" for i in range(200))
    with sink_process(sink_db) as sink, dashboard(queue, "--sink-db", sink_db) as url:
        browser.get(url)
        shows(
            browser,
            {
                "by_status.pending": "0",
                "by_status.done": "0",
                "inbox.effects_applied": "0",
                "audit.violations": "0",
            },
        )
        browser.execute_script("window.asnackqLoaded = 'once'")
        ok("enqueue", queue, "-", stdin=jobs)
        ok("enqueue", queue, "--id", "late-1", "--qty", "3", "--ttl-ms", "1")  # dies at once
        shows(browser, {"by_status.pending": "201", "by_status.done": "0"})
        ok("work", queue, "--sink", sink, "--until-empty", "--accept-dead", "--concurrency", "16")
        shows(
            browser,
            {
                "by_status.pending": "0",
                "by_status.leased": "0",
                "by_status.done": "200",
                "by_status.dead": "1",
                "dead_by_reason.deadline": "1",
                "inbox.effects_applied": "200",
                "inbox.duplicates": "0",
                "audit.violations": "0",
            },
        )
        assert number(browser, "throughput.done_per_s") > 0
        ok("redrive", queue, "late-1", "--ttl-ms", "60000", "--note", "replay")
        shows(browser, {"by_status.dead": "0", "by_status.pending": "1"})
        redrives = browser.find_element(ID, "redrives").text
        assert "late-1" in redrives and "replay" in redrives
        ok("work", queue, "--sink", sink, "--until-empty", "--concurrency", "16")
        shows(
            browser,
            {
                "by_status.pending": "0",
                "by_status.done": "201",
                "by_status.dead": "0",
                "inbox.effects_applied": "201",
                "inbox.stock": f"{sum(i % 5 + 1 for i in range(200)) + 3:,}",
            },
        )
        assert browser.execute_script("return window.asnackqLoaded") == "once"  # no reload
        assert browser.find_element(CSS, "#spark polyline").get_attribute("points")
        assert not browser.find_element(ID, "error").is_displayed()
        png = screenshot(browser, tmp_path, "dashboard.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
