"""The dashboard's job inspector in a real browser (headless Chromium): a job searched by id
shows its row, trace id, inbox record and verdict; the leases by owner and the chart of done/s
over the last hour are drawn; an unknown id says so."""

from __future__ import annotations

import math
import sqlite3

from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.lab.procs import sink_process
from asnackq.wire.send import HttpSender

from .browser import CSS, ID, screenshot, wait_for
from .sinks import add_records
from .test_dashboard import dashboard

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def an_hour_of_work(queue, now):
    """Jobs finished over the last hour (a slow start, a peak, a dip), and leases held now;
    the rows of the finished ones in a sink's inbox."""
    con = w.open_queue(queue)
    done = []
    for ago in range(58, -1, -1):  # the clock's minute `ago` minutes before the current one
        at = (now // 60_000 - ago) * 60_000  # its first millisecond: never after now
        count = round(30 + 25 * math.sin(ago / 9) + (40 if 20 <= ago < 26 else 0))
        items = [({"id": f"m{ago}-{i}", "qty": 1}, 1000, 3) for i in range(count)]
        w.enqueue_many(con, items, at)
        tickets = w.claim_many(con, "worker-z", at, 1000, count)
        w.finish_many(con, [(ticket, "ok", at + 1, 0) for ticket in tickets])
        done += [(ticket["id"], at) for ticket in tickets]
    for name, count in (("worker-a", 5), ("worker-b", 3)):
        w.enqueue_many(
            con, [({"id": f"{name}-job-{i}", "qty": 2}, 60_000, 3) for i in range(count)], now
        )
        w.claim_many(con, name, now, 60_000, count)
    con.close()
    return done


def applied(sink_db, done):
    """The inbox rows of jobs applied once each (qty 1, token 1)."""
    con = sqlite3.connect(sink_db)
    with con:
        rows = [(job_id, at) for job_id, at in done]
        add_records(con, [(job_id, 1, 1, 1, 1, at, at) for job_id, at in rows])
        con.execute("UPDATE stock SET total = total + ?", (len(rows),))
    con.close()


def delivered_twice(queue, sink, now):
    """order-42: sent with token 1, its lease lost, sent again with token 2, done; traced."""
    con = w.open_queue(queue)
    w.enqueue(con, {"id": "order-42", "qty": 3}, now, 60_000)
    first = w.claim(con, "worker-a", now, lease_ms=1)
    assert HttpSender(sink)({"id": "order-42", "qty": 3}, token=first["token"]) is True
    second = w.claim(con, "worker-b", now + 5)
    assert HttpSender(sink)({"id": "order-42", "qty": 3}, token=second["token"]) is True
    assert w.finish(con, second, "ok", now + 10) == "done"
    con.execute(
        "CREATE TABLE asnackq_job_traces (job_id TEXT PRIMARY KEY, traceparent TEXT NOT NULL)"
    )
    con.execute(
        "INSERT INTO asnackq_job_traces VALUES (?, ?)",
        ("order-42", f"00-{TRACE_ID}-b7ad6b7169203331-01"),
    )
    con.close()


def cells(driver, body):
    """The inspector's key/value table ``body`` as a dict of texts (read at one instant)."""
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll(arguments[0])]"
        ".map((cell) => [cell.dataset.key, cell.textContent]))",
        f"#{body} td[data-key]",
    )


def test_a_job_found_by_id_and_who_holds_what(browser, tmp_path):
    queue, sink_db, now = tmp_path / "queue.db", tmp_path / "sink.db", epoch_ms()
    done = an_hour_of_work(queue, now)
    with sink_process(sink_db) as sink:
        delivered_twice(queue, sink, now)
    applied(sink_db, done)
    with dashboard(queue, "--sink-db", sink_db) as url:
        browser.get(url)

        def leases():
            text = browser.find_element(ID, "leases").text
            return "worker-a 5" in text and "worker-b 3" in text, text

        wait_for(leases, what="the leases by owner")
        assert "worker-a-job-0 (1," in browser.find_element(ID, "leases").text
        heights = browser.execute_script(  # the bars, read at one instant (redrawn each second)
            "return [...document.querySelectorAll('#hour rect')]"
            ".map((bar) => +bar.getAttribute('height'))"
        )
        assert len(heights) == 60 and sum(h > 0 for h in heights) == 59 and max(heights) == 116
        shown_done = browser.find_element(CSS, '[data-field="hour.done"]').text
        assert int(shown_done.replace(",", "")) == len(done) + 1  # and order-42
        wait_for(
            lambda: (
                (v := browser.find_element(CSS, '[data-field="audit.violations"]').text) == "0",
                v,
            )
        )

        box = browser.find_element(ID, "job-id")
        box.send_keys("order-42\n")
        row = wait_for(
            lambda: ((seen := cells(browser, "job-row")).get("status") == "done", seen),
            what="the inspected job",
        )
        assert row["token"] == "2" and row["attempts"] == "2 of 3" and row["trace id"] == TRACE_ID
        inbox = cells(browser, "job-inbox")
        assert (inbox["first token"], inbox["last token"], inbox["deliveries"]) == ("1", "2", "2")
        assert cells(browser, "job-audit") == {"stage": "done", "verdict": "nothing to flag"}
        assert browser.current_url == f"{url}jobs/order-42"
        png = screenshot(browser, tmp_path, "dashboard-inspector.png")

        browser.execute_script("document.querySelector('#leases a').click()")  # inspect it
        wait_for(lambda: (cells(browser, "job-row").get("lease owner") == "worker-a", None))
        assert "left" in cells(browser, "job-row")["lease"]

        browser.get(f"{url}jobs/nope")
        said = wait_for(
            lambda: ("no job 'nope'" in (text := browser.find_element(ID, "said").text), text)
        )
        assert said == "no job 'nope' in the queue or the sink DB"
        assert not browser.find_element(ID, "story").is_displayed()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    con = sqlite3.connect(f"{queue.as_uri()}?mode=ro", uri=True)
    assert con.execute("SELECT count(*) FROM jobs WHERE status = 'leased'").fetchone() == (8,)
    con.close()
