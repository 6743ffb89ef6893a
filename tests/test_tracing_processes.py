"""OpenTelemetry across processes: a real ``asnackq enqueue``, ``sink`` and two ``work``
processes (one SIGKILLed after its first ACK) export over OTLP/HTTP to a small aiohttp
receiver in the test, which decodes each ``ExportTraceServiceRequest``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from asnackq.cli.otel import FLUSH_S
from asnackq.core import worker as w
from asnackq.lab import procs
from asnackq.lab.pg_server import free_port

from .sinks import serving

KINDS = {2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def decoded(body: bytes) -> list[dict[str, Any]]:
    """The spans of one OTLP request: ids in hex, attributes as plain values."""
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {
                    a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes
                }
                spans.append(
                    {
                        "service": resource["service.name"],
                        "trace": span.trace_id.hex(),
                        "span": span.span_id.hex(),
                        "parent": span.parent_span_id.hex() or None,
                        "name": span.name,
                        "kind": KINDS.get(span.kind, str(span.kind)),
                        "attributes": attributes,
                    }
                )
    return spans


@contextlib.asynccontextmanager
async def receiver() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []

    async def export(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        received.extend(decoded(await request.read()))
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    async with serving(app) as running:
        yield running.base, received


async def asnackq(env: dict[str, str], *args: str, **options: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asnackq", *args, env=env, **options
    )


async def finished(process: asyncio.subprocess.Process) -> int:
    return await asyncio.wait_for(process.wait(), 30)


@pytest.mark.process
async def test_a_killed_workers_job_is_redelivered_in_its_enqueues_trace(tmp_path: Path):
    queue, jobs = tmp_path / "q.db", tmp_path / "jobs.jsonl"
    jobs.write_text("".join(f'{{"id": "job-{i}", "qty": {i + 1}}}\n' for i in range(4)))
    async with receiver() as (endpoint, received):
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        otlp = ("--otel-exporter", "otlp")
        assert await finished(await asnackq(env, "init", str(queue))) == 0
        assert await finished(await asnackq(env, "enqueue", str(queue), str(jobs), *otlp)) == 0
        sink = await asnackq(
            env, "sink", "--db", str(tmp_path / "s.db"), *otlp, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert sink.stdout is not None
            url = (await asyncio.wait_for(sink.stdout.readline(), 30)).decode().split()[-1]
            work = (
                "work",
                str(queue),
                "--sink",
                url,
                "--until-empty",
                "--lease-ms",
                "1000",
                "--timeout-s",
                "0.5",
            )
            killed = await asnackq(
                env, *work, "--concurrency", "1", "--kill-after-acks", "1", *otlp
            )
            assert await finished(killed) == -signal.SIGKILL
            assert await finished(await asnackq(env, *work, "--json", *otlp, stdout=-3)) == 0
        finally:
            sink.send_signal(signal.SIGTERM)
            assert await finished(sink) == 0
    traces = defaultdict(list)
    for span in received:
        traces[span["trace"]].append(span)
    enqueues = {
        s["attributes"]["messaging.message.id"]: s for s in received if s["kind"] == "PRODUCER"
    }
    assert sorted(enqueues) == [f"job-{i}" for i in range(4)]
    assert {s["service"] for s in enqueues.values()} == {"asnackq-enqueue"}
    assert len(traces) == 4  # one trace per job, nothing else
    redelivered, unexported = [], []
    for job_id, enqueue in enqueues.items():
        trace = traces[enqueue["trace"]]
        spans = {s["span"]: s for s in trace}
        servers = [s for s in trace if s["kind"] == "SERVER"]
        consumers = [s for s in trace if s["kind"] == "CONSUMER"]
        assert all(s["parent"] == enqueue["span"] for s in consumers)
        assert all(s["attributes"]["messaging.message.id"] == job_id for s in consumers + servers)
        for server in servers:  # under the send's CLIENT span, if its worker lived to export it
            client = spans.get(server["parent"])
            assert client is None or client["kind"] == "CLIENT"
            assert client is None or spans[client["parent"]]["kind"] == "CONSUMER"
        if len(servers) == 2:
            redelivered.append(job_id)
            tokens = sorted(s["attributes"]["asnackq.token"] for s in servers)
            decisions = sorted(s["attributes"]["asnackq.inbox.decision"] for s in servers)
            assert tokens == [1, 2] and decisions == ["applied", "duplicate"]
            by_token = {s["attributes"]["asnackq.token"]: s for s in consumers}
            assert len(by_token) == len(consumers) and set(by_token) <= {1, 2}
            again = by_token[2]  # the redelivery
            assert again["attributes"]["asnackq.result"] == "done"
            assert again["service"] == "asnackq-work"
            if 1 in by_token:  # (its send timed out on a busy machine, the lease then lost:
                # the killed worker gave it up, and lived to export that, before its ACK)
                assert by_token[1]["attributes"]["asnackq.result"] in ("lost", "unanswered")
            else:
                unexported.append(job_id)  # the killed worker's span was never exported
        else:
            (server,) = servers
            assert spans[server["parent"]]["kind"] == "CLIENT"
            assert server["attributes"]["asnackq.inbox.decision"] == "applied"
    assert len(unexported) == 1 and 1 <= len(redelivered) <= 2  # (the ACK it died after: one)


@pytest.mark.process
def test_without_the_sdk_an_exporter_is_one_line_and_exit_2(tmp_path: Path):
    """The SDK hidden from the child (``sys.modules``): one line, exit 2, no file made."""
    hide = "import sys; sys.modules['opentelemetry.sdk'] = None; from asnackq.cli import main; "
    for args in (
        ["work", str(tmp_path / "q.db"), "--sink", "http://127.0.0.1:9/events"],
        ["sink", "--db", str(tmp_path / "s.db")],
        ["enqueue", str(tmp_path / "q.db"), "--id", "a", "--qty", "1"],
    ):
        code = hide + f"sys.exit(main({[*args, '--otel-exporter', 'otlp']!r}))"
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
        assert child.returncode == 2 and child.stdout == ""
        assert child.stderr.splitlines() == [
            f"asnackq {args[0]}: --otel-exporter needs the OpenTelemetry SDK: pip install "
            "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"
        ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_the_console_exporter_prints_spans_on_stderr_and_leaves_stdout_alone(tmp_path: Path):
    queue = tmp_path / "q.db"
    command = [sys.executable, "-m", "asnackq"]
    subprocess.run([*command, "init", str(queue)], check=True, capture_output=True, timeout=30)
    args = ["enqueue", str(queue), "--id", "a", "--qty", "1", "--json", "--otel-exporter"]
    child = subprocess.run(
        [*command, *args, "console"], capture_output=True, text=True, timeout=30, check=False
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout)["inserted"] == 1
    span = json.loads(child.stderr)
    assert (span["name"], span["kind"]) == ("enqueue jobs", "SpanKind.PRODUCER")
    con = sqlite3.connect(queue)
    try:
        (row,) = con.execute("SELECT job_id, traceparent FROM asnackq_job_traces").fetchall()
    finally:
        con.close()
    assert row[0] == "a" and row[1][3:35] == span["context"]["trace_id"][2:]


@pytest.mark.process
def test_with_no_collector_listening_a_command_ends_within_its_flush_time(tmp_path: Path):
    """``enqueue --otel-exporter otlp`` with nothing on the endpoint's port enqueues, exits 0,
    and gives its last spans ``FLUSH_S`` (2 s), not the exporter's retries (about 7 s more):
    timed against the same command exporting to the console, which starts as slowly on a
    busy machine."""
    queue = tmp_path / "q.db"
    command = [sys.executable, "-m", "asnackq"]
    subprocess.run([*command, "init", str(queue)], check=True, capture_output=True, timeout=30)
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    took = {}
    for job, exporter in (("b", "console"), ("a", "otlp")):
        args = ["enqueue", str(queue), "--id", job, "--qty", "1", "--otel-exporter", exporter]
        began = time.monotonic()
        child = subprocess.run(
            [*command, *args], env=env, capture_output=True, text=True, timeout=30, check=False
        )
        took[exporter] = time.monotonic() - began
        assert child.returncode == 0 and "inserted 1" in child.stdout, child.stderr
    assert took["otlp"] - took["console"] < FLUSH_S + 2.5, took
    assert "Traceback" not in child.stderr and "already shutdown" not in child.stderr


@pytest.mark.process
def test_a_collector_that_accepts_and_never_answers_delays_a_command_about_two_seconds(
    tmp_path,
):
    """A collector that takes the connection and never answers: the export in flight is
    left behind after its 2 s (it would wait out the exporter's 10 s timeout)."""
    queue = tmp_path / "queue.db"
    w.open_queue(queue).close()
    events = tmp_path / "events.jsonl"
    events.write_text('{"id": "a", "qty": 1}\n', encoding="utf-8")
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accept every connection, never answer
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept)
    thread.start()
    port = listener.getsockname()[1]
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    try:
        began = time.monotonic()
        done = subprocess.run(
            [*procs.command("enqueue", queue, events, "--otel-exporter", "otlp")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        took = time.monotonic() - began
    finally:
        stop.set()
        thread.join(10)
        for conn in held:
            conn.close()
        listener.close()
    assert done.returncode == 0, done.stderr
    # left behind after its 2 s, not the exporter's 10 s: the interpreter's start and a busy
    # machine's slack on top of the 2 s stay well under that
    assert took < 9.0, (took, done.stderr)


@pytest.mark.process
def test_spans_to_a_full_device_drop_the_spans_in_one_line_and_every_job_is_done(tmp_path):
    """``--spans /dev/full``: every write fails (ENOSPC); the run delivers every job and
    says once that spans are dropped: no traceback per span."""
    from asnackq.lab.procs import sink_process

    queue = tmp_path / "q.db"
    con = w.open_queue(queue)
    w.enqueue_many(con, [({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(200)], w.epoch_ms())
    con.close()
    with sink_process(tmp_path / "sink.db") as url:
        argv = ["work", queue, "--sink", url, "--until-empty", "--json", "--spans", "/dev/full"]
        done = subprocess.run(
            [sys.executable, "-m", "asnackq", *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done"] == 200
    said = [line for line in done.stderr.splitlines() if "spans" in line]
    assert len(said) == 1 and "No space left on device" in said[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.process
def test_spans_to_a_fifo_is_one_line_at_start_and_never_blocks(tmp_path):
    fifo = tmp_path / "spans"
    os.mkfifo(fifo)
    queue = tmp_path / "q.db"
    w.open_queue(queue).close()
    argv = ["work", queue, "--sink", "http://127.0.0.1:9/e", "--until-empty", "--spans", fifo]
    done = subprocess.run(
        [sys.executable, "-m", "asnackq", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"asnackq work: --spans {fifo}: not a file to append spans to"
    ], done.stderr
