"""Each endpoint on the dashboard, a real process, in a real browser (headless Chromium): the
endpoints' table (state, backlog, in flight, done, dead, breaker, limit), an event searched
by id with its deliveries by endpoint and their attempts, a delivery with its event and
endpoint; ``/metrics`` and ``/api/jobs/{id}`` of the same process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from asnackq.aio import AsyncQueue
from asnackq.core import lanes
from asnackq.core import worker as w

from .browser import ID, screenshot, wait_for
from .test_browser_jobs import cells
from .test_dashboard import dashboard, request
from .test_endpoint_stats import a_queue_with_traffic

REASON = "partner asked [bold]to pause[/bold]"  # (shown as written: text, never markup)
AHEAD_MS = 300_000  # a note dated ahead of the clock stays fresh however slow the browser starts


def rows(driver: Any, body: str) -> list[list[str]]:
    """The cells' texts of a table body, row by row (read at one instant)."""
    found: list[list[str]] = driver.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tr`)]"
        ".map((row) => [...row.cells].map((cell) => cell.textContent))",
        body,
    )
    return found


async def traffic(queue_path: Path, now: int) -> None:
    async with AsyncQueue.open(queue_path) as queue:
        await a_queue_with_traffic(queue, now)
        await queue.note_endpoints("w1", [("a", True, 4, 1)], now + AHEAD_MS)


def test_each_endpoint_and_an_events_deliveries_on_the_dashboard(
    browser: Any, tmp_path: Path
) -> None:
    queue, now = tmp_path / "queue.db", w.epoch_ms()
    asyncio.run(traffic(queue, now))
    with dashboard(queue) as url:
        status, _, body = request(url, "/metrics")
        assert status == 200
        samples = {
            (s.name, s.labels.get("endpoint"), s.labels.get("status")): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        assert samples[("asnackq_endpoint_deliveries", "a", "pending")] == 2
        assert samples[("asnackq_endpoint_deliveries", "b", "pending")] == 3
        assert samples[("asnackq_endpoint_breaker_open_workers", "a", None)] == 1
        assert samples[("asnackq_endpoint_enabled", "c", None)] == 0
        status, _, body = request(url, "/api/jobs/a1")
        story = json.loads(body)
        assert status == 200 and story["event"]["type"] == "a.x" and story["job"] is None
        assert [(d["endpoint"], d["status"]) for d in story["deliveries"]] == [("a", "dead")]

        browser.get(url)
        table = wait_for(
            lambda: (len(found := rows(browser, "endpoints")) == 3, found),
            what="the endpoints' table",
        )
        shown = [[row[i] for i in (0, 1, 2, 4, 5, 6, 7, 8)] for row in table]
        assert shown == [
            ["a", "enabled", "2", "1", "1", "1", "open", "4"],
            ["b", "enabled", "3", "0", "0", "0", "no worker", "-"],
            ["c", f"disabled: {REASON}", "0", "0", "0", "0", "no worker", "-"],
        ]
        assert table[0][3].endswith(" s") and table[2][3] == "-"  # the oldest pending's wait

        browser.find_element(ID, "job-id").send_keys("a1\n")
        deliveries = wait_for(
            lambda: (len(found := rows(browser, "job-deliveries")) == 1, found),
            what="the event's deliveries",
        )
        [[job, endpoint, state, attempts, kept]] = deliveries
        assert (job, endpoint, state) == (lanes.delivery_id("a", 2), "a", "dead (permanent)")
        assert attempts.startswith("1 of ") and kept == "none kept"
        assert cells(browser, "job-row")["status"] == "an event, no job"
        png = screenshot(browser, tmp_path, "dashboard-endpoints.png")

        browser.execute_script("document.querySelector('#job-deliveries a').click()")
        row = wait_for(
            lambda: ((found := cells(browser, "job-row")).get("status") == "dead", found),
            what="the delivery inspected",
        )
        assert (row["event"], row["endpoint"]) == ("a1", "a")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
