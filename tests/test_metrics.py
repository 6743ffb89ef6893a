"""Prometheus metrics: the rendering, parsed with the official client's text parser, and
``asnackq work --metrics-port`` as a real process, scraped while it runs."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asnackq import ops
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import epoch_ms
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.lab.procs import PIPE, Replicas, kill, worker
from asnackq.store import readers
from asnackq.wire.metrics import Family, Histogram, queue_families, render
from asnackq.wire.send import AsyncHttpSender

from .sinks import dead_port
from .test_cli import fails, ok


def parse(text):
    """{family name: (type, {(sample name, sorted labels): value})}."""
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = (
            family.type,
            {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples},
        )
    return families


def value(families, family, sample=None, **labels):
    return families[family][1][(sample or family, tuple(sorted(labels.items())))]


def scrape(url):
    with urllib.request.urlopen(url, timeout=5) as answer:
        assert answer.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return answer.read().decode()


def test_every_family_has_help_and_type_and_escapes_its_labels():
    histogram = Histogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(seconds)
    text = render(
        [
            Family("asnackq_x_total", "counter", 'a "help"\nline', [("", {}, 3)]),
            Family("asnackq_g", "gauge", "g", [("", {"k": 'q"\\\n'}, 1.5)]),
            histogram.family("asnackq_h_seconds", "h"),
        ]
    )
    lines = text.splitlines()
    for name in ("asnackq_x_total", "asnackq_g", "asnackq_h_seconds"):
        assert any(line.startswith(f"# HELP {name} ") for line in lines)
        assert any(line.startswith(f"# TYPE {name} ") for line in lines)
    families = parse(text)
    assert (
        families["asnackq_x"][0] == "counter"
        and value(families, "asnackq_x", "asnackq_x_total") == 3
    )
    assert value(families, "asnackq_g", k='q"\\\n') == 1.5
    kind, samples = families["asnackq_h_seconds"]
    assert kind == "histogram"
    buckets = {
        dict(labels)["le"]: v for (name, labels), v in samples.items() if name.endswith("_bucket")
    }
    assert buckets == {"0.1": 2, "1.0": 3, "+Inf": 4}  # cumulative, le inclusive
    assert value(families, "asnackq_h_seconds", "asnackq_h_seconds_count") == 4
    assert value(families, "asnackq_h_seconds", "asnackq_h_seconds_sum") == pytest.approx(3.65)


def test_queue_metrics_from_a_real_queue(tmp_path):
    queue = tmp_path / "q.db"
    ops.enqueue_all(queue, [({"id": f"j-{i}", "qty": 1}, 60_000, 3) for i in range(5)])
    with readers.read_only(queue, "jobs") as con:
        stats = ops.stats(con, epoch_ms() + 1500)
    families = parse(render(queue_families(stats)))
    assert {name: kind for name, (kind, _) in families.items()} == {
        "asnackq_queue_jobs": "gauge",
        "asnackq_queue_dead_jobs": "gauge",
        "asnackq_queue_oldest_pending_age_seconds": "gauge",
        "asnackq_queue_expired_leases": "gauge",
    }
    assert value(families, "asnackq_queue_jobs", status="pending") == 5
    assert value(families, "asnackq_queue_jobs", status="dead") == 0
    assert value(families, "asnackq_queue_dead_jobs", reason="exhausted") == 0
    assert 1.5 <= value(families, "asnackq_queue_oldest_pending_age_seconds") < 60


async def test_the_breaker_counts_are_live_while_the_run_goes_on(db):
    async with (
        AsyncQueue.open(db) as queue,
        AsyncHttpSender(f"http://127.0.0.1:{dead_port()}/events", timeout_s=0.2) as send,
    ):
        await queue.enqueue_many([({"id": "j", "qty": 1}, 60_000, 3)], epoch_ms())
        dispatcher = Dispatcher(
            queue,
            send,
            owner="d",
            concurrency=2,
            lease_ms=1000,
            grace_s=0.2,
            breaker=BreakerPolicy(after=2, base_ms=20, max_ms=50),
        )
        run = asyncio.ensure_future(dispatcher.run(follow=True))
        for _ in range(1000):  # at most 10 s for the breaker to open
            if dispatcher.paused:
                break
            await asyncio.sleep(0.01)
        first, settled = dispatcher.snapshot(), dispatcher.summary.outages
        later = dispatcher.snapshot()
        for _ in range(1000):  # at most 10 s for the pause to grow by 100 ms
            if later["paused_ms"] >= first["paused_ms"] + 100:
                break
            await asyncio.sleep(0.01)
            later = dispatcher.snapshot()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert first["outages"] >= 1 and settled == 0  # the summary settles last
    assert later["paused_ms"] >= first["paused_ms"] + 100  # an outage going on
    assert dispatcher.snapshot() == dispatcher.summary.as_dict()  # settled: the same


@pytest.fixture
def slow_sink(tmp_path):
    with Replicas(tmp_path / "sink.db", 1, "--delay-ms", "5") as sinks:
        yield sinks.urls[0]
    assert sinks.codes == [0]


def worker_metrics_url(work):
    line = work.stderr.readline()
    assert line.startswith("asnackq work: metrics on http://127.0.0.1:"), line
    return line.split()[-1]


@pytest.mark.process
def test_work_exposes_its_counters_and_send_latency_while_it_runs(tmp_path, slow_sink):
    queue = tmp_path / "q.db"
    ok("init", queue)
    jobs = "".join(json.dumps({"id": f"j-{i}", "qty": 1}) + "\n" for i in range(200))
    ok("enqueue", queue, "-", stdin=jobs)
    work = worker(
        queue,
        slow_sink,
        "--concurrency",
        "8",
        "--owner",
        "w-1",
        "--json",
        "--metrics-port",
        "0",  # follows the queue until SIGTERM
        stdout=PIPE,
        stderr=PIPE,
    )
    try:
        url = worker_metrics_url(work)
        seen, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:
            families = parse(scrape(url))
            seen.append(value(families, "asnackq_worker_done", "asnackq_worker_done_total"))
            if seen[-1] == 200:
                break
        base = url.rsplit("/", 1)[0]
        for method, path, code in (
            ("POST", "/metrics", 405),
            ("DELETE", "/metrics", 405),
            ("GET", "/", 404),
            ("GET", "/metrics/x", 404),
        ):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(
                    urllib.request.Request(base + path, method=method), timeout=5
                )
            refused.value.close()
            assert refused.value.code == code
        # DNS rebinding: a page's own name resolving to 127.0.0.1 is refused, loopback is not.
        for host, code in (("evil.example", 421), ("evil.example:80", 421), ("10.0.0.1", 421)):
            request = urllib.request.Request(url, headers={"Host": host})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5)
            refused.value.close()
            assert refused.value.code == code, host
        port = url.split(":")[2].split("/")[0]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
            request = urllib.request.Request(url, headers={"Host": host})
            with urllib.request.urlopen(request, timeout=5) as answer:
                assert answer.status == 200, host
        work.send_signal(signal.SIGTERM)
        out, err = work.communicate(timeout=30)
    finally:
        kill(work)  # if still running: an assertion failed
    assert work.returncode == 0, err
    assert seen[-1] == 200 and len(set(seen)) > 1  # it moved while it was watched
    summary = json.loads(out)
    assert value(families, "asnackq_worker_info", owner="w-1") == 1
    # The idle worker polls the queue (one commit each) between the last scrape and SIGTERM.
    commits = value(families, "asnackq_worker_commits", "asnackq_worker_commits_total")
    assert 0 < commits <= summary["commits"]
    for key in (
        "claimed",
        "done",
        "retried",
        "stale",
        "lost",
        "requests",
        "bad_acks",
        "errors",
        "resent",
        "extended",
        "overloaded",
    ):
        assert (
            value(families, f"asnackq_worker_{key}", f"asnackq_worker_{key}_total") == summary[key]
        ), key
    for reason in ("exhausted", "deadline", "permanent", "poison"):
        assert (
            value(families, "asnackq_worker_dead", "asnackq_worker_dead_total", reason=reason) == 0
        )
    assert value(families, "asnackq_worker_breaker_open") == 0
    assert value(families, "asnackq_worker_concurrency") == summary["concurrency"] == 8
    kind = families["asnackq_worker_send_duration_seconds"][0]
    count = value(
        families,
        "asnackq_worker_send_duration_seconds",
        "asnackq_worker_send_duration_seconds_count",
    )
    assert kind == "histogram" and count == summary["requests"] == 200
    assert (
        value(
            families,
            "asnackq_worker_send_duration_seconds",
            "asnackq_worker_send_duration_seconds_bucket",
            le="0.005",
        )
        == 0
    )  # 5 ms delay
    assert (
        value(
            families,
            "asnackq_worker_send_duration_seconds",
            "asnackq_worker_send_duration_seconds_sum",
        )
        >= 200 * 0.005
    )


@pytest.mark.process
def test_work_refuses_bad_metrics_options_before_touching_anything(tmp_path):
    queue = tmp_path / "q.db"
    ok("init", queue)
    before = queue.read_bytes()
    sink = f"http://127.0.0.1:{dead_port()}/events"
    for bad in ("70000", "-1", "x", "99999999999999999999"):
        assert "--metrics-port" in fails(
            "work", queue, "--sink", sink, "--metrics-port", bad, code=2
        )
    why = fails("work", queue, "--sink", sink, "--metrics-port", "0", "--metrics-host", "0.0.0.0")
    assert "without --allow-remote" in why and why.count("\n") == 1
    assert queue.read_bytes() == before
