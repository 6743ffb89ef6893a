"""Ordered delivery through the outbox: seq order, stop at the first failure, evidence only."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys

import pytest
from aiohttp import web

from asnackq.core import outbox
from asnackq.core.worker import BadAck, Conflict, Retryable
from asnackq.lab.procs import command, sink_process
from asnackq.wire.send import HttpSender

from .sinks import peer, serving, sink_state


@pytest.fixture
def source(tmp_path):
    con = outbox.open_source(tmp_path / "source.db")
    yield con
    assert not con.in_transaction
    con.close()


def unsent(con):
    return [row[0] for row in con.execute("SELECT id FROM outbox WHERE sent = 0 ORDER BY seq")]


class Recorder:
    def __init__(self, fail_at=None, error=None, mutate=False, during=None):
        self.sent, self.fail_at, self.error = [], fail_at, error or Retryable("lost")
        self.mutate, self.during = mutate, during

    def __call__(self, event):
        self.sent.append(dict(event))
        if self.during:
            self.during()
        if self.mutate:
            event["id"] = "c"
        if event.get("id") == self.fail_at or (self.mutate and len(self.sent) == 2):
            raise self.error
        return True


def test_accept_is_atomic_and_idempotent(source, tmp_path):
    assert outbox.accept(source, {"id": "a", "qty": 2}) is True
    assert outbox.accept(source, {"id": "a", "qty": 2}) is False
    with pytest.raises(Conflict):
        outbox.accept(source, {"id": "a", "qty": 3})
    for bad in ({"id": "a b", "qty": 1}, {"id": "b", "qty": True}, {"id": "b"}, None):
        with pytest.raises(ValueError):
            outbox.accept(source, bad)
    source.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON outbox WHEN NEW.id = 'x' "
        "BEGIN SELECT RAISE(ABORT, 'boom'); END"
    )
    with pytest.raises(sqlite3.IntegrityError):
        outbox.accept(source, {"id": "x", "qty": 1})
    assert source.execute("SELECT id FROM orders").fetchall() == [("a",)]  # no half intake
    assert unsent(source) == ["a"]


def test_pending_is_in_seq_order_not_id_order_and_reads_only(source):
    for event_id in ("zeta", "alpha", "mid"):
        outbox.accept(source, {"id": event_id, "qty": 1})
    before = source.total_changes
    assert [e["id"] for e in outbox.pending(source)] == ["zeta", "alpha", "mid"]
    assert [e["id"] for e in outbox.pending(source, 2)] == ["zeta", "alpha"]
    assert source.total_changes == before and not source.in_transaction
    for bad in (0, 17, True, 1.0):
        with pytest.raises(ValueError):
            outbox.pending(source, bad)


def test_a_failure_at_b_keeps_a_sent_and_the_next_run_resumes_at_b(source):
    for event_id in ("a", "b", "c"):
        outbox.accept(source, {"id": event_id, "qty": 1})
    error = Retryable("response lost")
    send = Recorder(fail_at="b", error=error)
    with pytest.raises(Retryable) as raised:
        outbox.dispatch(source, send)
    assert raised.value is error
    assert [e["id"] for e in send.sent] == ["a", "b"]  # c untried
    assert unsent(source) == ["b", "c"]
    assert outbox.dispatch(source, Recorder()) == ["b", "c"]
    assert unsent(source) == []
    assert outbox.mark_sent(source, "a") is False and outbox.mark_sent(source, "zz") is False


def test_a_send_that_mutates_its_argument_cannot_mark_the_wrong_row(source):
    for event_id in ("a", "b", "c"):
        outbox.accept(source, {"id": event_id, "qty": 1})
    with pytest.raises(Retryable):
        outbox.dispatch(source, Recorder(mutate=True))
    assert unsent(source) == ["b", "c"]


def test_a_non_true_ack_is_not_evidence(source):
    outbox.accept(source, {"id": "a", "qty": 1})
    with pytest.raises(BadAck):
        outbox.dispatch(source, lambda event: "ok")
    assert unsent(source) == ["a"]


def test_the_read_is_closed_before_sending(source, tmp_path):
    outbox.accept(source, {"id": "a", "qty": 1})

    def competing_writer():
        other = sqlite3.connect(tmp_path / "source.db", timeout=0)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
        finally:
            other.close()

    assert outbox.dispatch(source, Recorder(during=competing_writer)) == ["a"]


def test_hook_runs_after_the_verified_ack_before_the_mark(source):
    outbox.accept(source, {"id": "a", "qty": 1})
    seen = []
    outbox.dispatch(
        source, Recorder(), hook=lambda point, i: seen.append((point, i, unsent(source)))
    )
    assert seen == [("after-delivery", "a", ["a"])]


DISPATCHER = """
import os, sys
from asnackq.core import outbox
from asnackq.wire.send import HttpSender
def hook(point, event_id):
    if sys.argv[3] == "crash":
        os._exit(73)
con = outbox.open_source(sys.argv[1])
print(outbox.dispatch(con, HttpSender(sys.argv[2]), hook=hook))
"""


@pytest.mark.process
def test_seed_final_check_a_publisher_dies_after_the_ack_and_another_resends(source, tmp_path):
    outbox.accept(source, {"id": "snack-7", "qty": 7})
    with sink_process(tmp_path / "sink.db") as url:
        first = subprocess.run(
            [sys.executable, "-c", DISPATCHER, str(tmp_path / "source.db"), url, "crash"],
            timeout=60,
            check=False,
        )
        assert first.returncode == 73
        assert unsent(source) == ["snack-7"]
        assert sink_state(tmp_path / "sink.db") == (7, [("snack-7", 7, 1)])
        second = subprocess.run(
            [sys.executable, "-c", DISPATCHER, str(tmp_path / "source.db"), url, "live"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert second.stdout.strip() == "['snack-7']"
    assert sink_state(tmp_path / "sink.db") == (7, [("snack-7", 7, 2)])  # two requests, one effect
    assert unsent(source) == []


@pytest.mark.process
def test_a_dropped_ack_keeps_the_item_unsent_and_a_resend_is_a_duplicate(source, tmp_path):
    outbox.accept(source, {"id": "a", "qty": 4})
    with sink_process(tmp_path / "sink.db", "--drop-rate", "1") as url, pytest.raises(Retryable):
        outbox.dispatch(source, HttpSender(url))
    assert unsent(source) == ["a"]
    with sink_process(tmp_path / "sink.db") as url:
        assert outbox.dispatch(source, HttpSender(url)) == ["a"]
    assert sink_state(tmp_path / "sink.db") == (4, [("a", 4, 2)])


@pytest.mark.parametrize("answer", ["wrong-id", "oversized", "redirect"])
async def test_no_false_evidence_marks_an_item_sent(source, tmp_path, answer):
    outbox.accept(source, {"id": "a", "qty": 1})

    async def handler(request):
        if answer == "redirect":
            raise web.HTTPFound("/elsewhere")
        body = {"id": "b" if answer == "wrong-id" else "a", "status": "applied"}
        if answer == "oversized":
            body["pad"] = "x" * 10_000
        return web.json_response(body)

    def dispatch_in_thread(url):
        con = outbox.open_source(tmp_path / "source.db")  # sqlite3: one thread per connection
        try:
            return outbox.dispatch(con, HttpSender(url))
        finally:
            con.close()

    async with serving(peer(handler)) as running:
        with pytest.raises(BadAck):
            await asyncio.to_thread(dispatch_in_thread, running.url)
    assert unsent(source) == ["a"]


@pytest.mark.process
def test_outbox_commands(tmp_path):
    def run(*args):
        return subprocess.run(
            command("outbox", *args), capture_output=True, text=True, timeout=60, check=False
        )

    db = str(tmp_path / "src.db")
    assert json.loads(run("accept", db, "--id", "z", "--qty", "2").stdout)["accepted"] is True
    assert run("accept", db, "--id", "a", "--qty", "1").returncode == 0
    conflict = run("accept", db, "--id", "a", "--qty", "5")
    assert conflict.returncode == 1 and conflict.stderr.count("\n") == 1
    assert [e["id"] for e in json.loads(run("pending", db).stdout)] == ["z", "a"]
    with sink_process(tmp_path / "sink.db") as url:
        assert json.loads(run("dispatch", db, "--sink", url).stdout) == {"sent": ["z", "a"]}
    assert json.loads(run("pending", db).stdout) == []
    missing = run("pending", str(tmp_path / "nope.db"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
