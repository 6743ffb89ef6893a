"""Senders speaking webhook to receivers the project did not write: Python's
``http.server`` and plain aiohttp apps answering 204, 301, 410, 429 and never, each
verifying the Standard Webhooks signature with the official library."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.wire import webhooks as wh
from asnackq.wire.send import (
    TOKEN_HEADER,
    AsyncHttpSender,
    Gone,
    HttpSender,
    TimedOut,
    judge,
)

from .conftest import job
from .sequencer import until
from .sinks import peer, serving

SECRET = "whsec_" + base64.b64encode(bytes(range(7, 39))).decode()  # fixed: test ids name it
EVENT = {"id": "ev-1", "qty": 3}


class Receiver(http.server.ThreadingHTTPServer):
    """An ordinary webhook receiver on ``http.server``: verifies with the official
    library, records what it saw, answers ``status`` (204 by default) with no body."""

    daemon_threads = True

    def __init__(self, secret: str | None) -> None:
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        self.verifier = None if secret is None else Webhook(secret)
        self.status = 204
        self.seen: list[dict[str, str]] = []  # each request's headers, lower-cased
        self.refused = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}/hook"


class ReceiverHandler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        headers = {k.lower(): v for k, v in self.headers.items()}
        status = self.server.status
        if self.server.verifier is not None:
            try:
                self.server.verifier.verify(body, headers)
            except WebhookVerificationError:
                self.server.refused += 1
                status = 401
        self.server.seen.append(headers)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def receiver(secret: str | None = SECRET) -> Iterator[Receiver]:
    server = Receiver(secret)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


async def test_signed_sends_verify_with_the_official_library_and_keep_their_id() -> None:
    with receiver() as server:
        async with AsyncHttpSender(server.url, success="2xx", secrets=[SECRET]) as send:
            assert await send(EVENT, 7) is True
            assert await send(EVENT, 8) is True
        with HttpSender(server.url, success="2xx", secrets=[SECRET]) as sync_send:
            assert sync_send(EVENT, 9) is True
    assert server.refused == 0 and len(server.seen) == 3
    assert {h["webhook-id"] for h in server.seen} == {"ev-1"}  # the same id on every attempt
    assert [h[TOKEN_HEADER.lower()] for h in server.seen] == ["7", "8", "9"]
    assert all(abs(int(h["webhook-timestamp"]) - time.time()) < 120 for h in server.seen)


async def test_a_rotated_keyring_signs_with_both_secrets_and_a_wrong_one_is_refused() -> None:
    new = wh.new_secret()
    ring = wh.Keyring.of(SECRET).rotate(new, now_s=time.time())
    with receiver(new) as for_new, receiver(SECRET) as for_old:
        async with AsyncHttpSender(for_new.url, success="2xx", secrets=ring) as send:
            assert await send(EVENT, 1) is True
        async with AsyncHttpSender(for_old.url, success="2xx", secrets=ring) as send:
            assert await send(EVENT, 1) is True
        assert for_new.seen[0]["webhook-signature"].count("v1,") == 2
        async with AsyncHttpSender(for_new.url, success="2xx", secrets=[SECRET]) as send:
            with pytest.raises(w.BadAck, match="401"):
                await send(EVENT, 1)
    assert (for_new.refused, for_old.refused) == (1, 0)


async def test_unsigned_by_default_and_the_ack_rule_refuses_a_bare_204() -> None:
    with receiver(secret=None) as server:
        async with AsyncHttpSender(server.url) as send:
            with pytest.raises(w.BadAck, match=r"204 .*not an ACK"):
                await send(EVENT, 1)
        async with AsyncHttpSender(server.url, success="2xx") as send:
            assert await send(EVENT, 1) is True
    assert all("webhook-signature" not in h for h in server.seen)


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_any_2xx_is_success_under_the_2xx_rule_whatever_its_body(status: int) -> None:
    assert judge(status, b"<html>thanks</html>", "ev-1", None, "2xx") is True
    with pytest.raises(w.BadAck):
        judge(status, b"<html>thanks</html>", "ev-1", None, "ack")


@pytest.mark.parametrize("success", ["ack", "2xx"])
def test_what_each_status_means_under_either_rule(success: str) -> None:
    for status in (301, 302, 303, 307, 308):
        with pytest.raises(w.BadAck, match="a redirect, never followed"):
            judge(status, b"", "ev-1", None, success)
    with pytest.raises(Gone):
        judge(410, b"", "ev-1", None, success)
    for status in (429, 502, 503, 504):
        with pytest.raises(w.Overloaded) as overloaded:
            judge(status, b"", "ev-1", "7", success)
        assert overloaded.value.retry_after_s == 7
    with pytest.raises(w.Overloaded):
        judge(429, b"", "ev-1", None, success)
    for status in (502, 503, 504):  # no Retry-After: the receiver is away
        with pytest.raises(w.Unavailable) as away:
            judge(status, b"", "ev-1", None, success)
        assert not isinstance(away.value, w.Overloaded)
    with pytest.raises(w.Permanent):
        judge(422, b"", "ev-1", None, success)
    with pytest.raises(w.Retryable):
        judge(500, b"", "ev-1", None, success)


HITS = web.AppKey("hits", list[str])


def plain(status: int, headers: dict[str, str] | None = None) -> web.Application:
    """A plain aiohttp receiver answering ``status`` with no body; ``app[HITS]``: the ids."""
    hits: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        hits.append(request.headers.get("webhook-id", ""))
        return web.Response(status=status, headers=headers)

    app = peer(handler)
    app[HITS] = hits
    return app


async def test_plain_aiohttp_receivers_answering_204_301_410_429_and_never() -> None:
    async with serving(plain(204)) as ok, serving(plain(410)) as gone:
        async with AsyncHttpSender(ok.url, success="2xx", secrets=[SECRET]) as send:
            assert await send(EVENT, 1) is True
        async with AsyncHttpSender(gone.url, success="2xx") as send:
            with pytest.raises(Gone):
                await send(EVENT, 1)
    async with serving(plain(204)) as target:
        moved = plain(301, {"Location": target.url})
        async with serving(moved) as redirecting:
            async with AsyncHttpSender(redirecting.url, success="2xx") as send:
                with pytest.raises(w.BadAck, match="redirect"):
                    await send(EVENT, 1)
            assert target.app[HITS] == []  # never followed
    busy = serving(plain(429, {"Retry-After": "3"}))
    async with busy as running, AsyncHttpSender(running.url, success="2xx") as send:
        with pytest.raises(w.Overloaded) as overloaded:
            await send(EVENT, 1)
    assert overloaded.value.retry_after_s == 3
    answered, released = asyncio.Event(), asyncio.Event()

    async def never(request: web.Request) -> web.StreamResponse:
        answered.set()
        await released.wait()  # (until the sender has given up)
        return web.Response(status=204)

    async with serving(peer(never)) as silent:
        sender = AsyncHttpSender(silent.url, success="2xx", timeout_s=0.5)
        async with sender as send:
            with pytest.raises(TimedOut):
                await send(EVENT, 1)
        released.set()
    assert answered.is_set()


def fate(db: Path, job_id: str) -> tuple[str, int, int]:
    row = job(db, job_id)
    assert row is not None
    return row["status"], row["attempts"], row["token"]


def delayed(seconds: float, statuses: list[int]) -> web.Application:
    """A receiver taking ``seconds`` per answer, answering ``statuses`` in turn (the last
    one from then on)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        return web.Response(status=status)

    return peer(handler)


async def test_a_partner_taking_4_s_gets_each_job_once_under_a_1_s_lease(db: Path) -> None:
    async with AsyncQueue.open(db) as queue, serving(delayed(4, [204])) as partner:
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(4)])
        async with AsyncHttpSender(partner.url, success="2xx", secrets=[SECRET]) as send:
            summary = await Dispatcher(queue, send, owner="d1", concurrency=4, lease_ms=1000).run(
                until_empty=True
            )
    assert summary.done == 4
    for i in range(4):  # done at the first attempt, under the first token
        assert fate(db, f"j{i}") == ("done", 1, 1)


async def test_a_partner_taking_14_s_is_within_the_default_timeout_and_keeps_its_lease(
    db: Path,
) -> None:
    async with AsyncQueue.open(db) as queue, serving(delayed(14, [204])) as partner:
        await queue.enqueue_many([({"id": "slow", "qty": 1}, 120_000, 3)])
        async with AsyncHttpSender(partner.url, success="2xx") as send:  # 15 s by default
            summary = await Dispatcher(queue, send, owner="d1", concurrency=1).run()
    assert (summary.done, summary.requests) == (1, 1)
    assert fate(db, "slow") == ("done", 1, 1)  # its 5 s lease extended, never lapsed


async def test_410_spends_no_attempt_and_the_job_is_delivered_when_the_receiver_is_back(
    db: Path,
) -> None:
    answers = [410] * 3 + [204]
    async with AsyncQueue.open(db) as queue, serving(delayed(0, answers)) as partner:
        await queue.enqueue_many([({"id": "j1", "qty": 1}, 60_000, 2)])
        async with AsyncHttpSender(partner.url, success="2xx") as send:
            dispatcher = Dispatcher(
                queue,
                send,
                owner="d1",
                concurrency=1,
                lease_ms=5000,
                breaker=BreakerPolicy(after=1, base_ms=20, max_ms=100),
            )
            summary = await dispatcher.run(until_empty=True)
    assert summary.done == 1 and len(answers) == 1
    assert fate(db, "j1") == ("done", 1, 1)  # three 410s spent nothing


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asnackq", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
def test_work_signs_for_a_204_receiver_from_a_secret_file(tmp_path: Path) -> None:
    queue = tmp_path / "q.db"
    secrets = tmp_path / "secrets"
    secrets.write_text(f"# rotated in\n{wh.new_secret()}\n\n{SECRET}\n")
    assert run_cli("init", str(queue)).returncode == 0
    for i in range(5):
        assert run_cli("enqueue", str(queue), "--id", f"e{i}", "--qty", "2").returncode == 0
    with receiver() as server:
        done = run_cli(
            "work", str(queue), "--sink", server.url, "--success", "2xx",
            "--secret-file", str(secrets), "--until-empty", "--json",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done"] == 5
    assert server.refused == 0 and len(server.seen) == 5
    assert all(h["webhook-signature"].count("v1,") == 2 for h in server.seen)
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.process
@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("whsec_tooshort\n", "line 1: "),
        (f"{SECRET}\nnot-a-secret-at-all\n", "line 2: "),
        ("# nothing\n\n", "holds 0 secrets"),
        (None, "No such file"),
        (b"\xff\xfe" + SECRET.encode(), "not ASCII text"),
    ],
    ids=["short", "second-line", "none", "missing", "binary"],
)
def test_a_bad_secret_file_is_a_one_line_usage_error(
    tmp_path: Path, content: str | bytes | None, says: str
) -> None:
    queue = tmp_path / "q.db"
    assert run_cli("init", str(queue)).returncode == 0
    path = tmp_path / "secrets"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    refused = run_cli(
        "work", str(queue), "--sink", "http://127.0.0.1:9/x", "--secret-file", str(path)
    )
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("asnackq work: ")
    assert "not-a-secret" not in refused.stderr and SECRET[6:] not in refused.stderr


def test_bad_rules_are_refused_by_the_senders() -> None:
    for bad in ({"success": "3xx"}, {"secrets": "whsec_x"}, {"secrets": ["whsec_x"]}):
        with pytest.raises(ValueError) as refused:
            HttpSender("http://127.0.0.1:9/x", **bad)  # type: ignore[arg-type]
        assert "whsec_x" not in str(refused.value).replace("'whsec_'", "")


async def test_the_ack_rule_still_needs_the_sinks_ack(db: Path, tmp_path: Path) -> None:
    """The default rule is unchanged: a sink's verified ACK, with signatures alongside."""
    from .sinks import sink, sink_state

    sink_db = tmp_path / "sink.db"
    async with AsyncQueue.open(db) as queue, sink(sink_db) as running:
        await queue.enqueue_many([({"id": f"j{i}", "qty": 2}, 60_000, 3) for i in range(3)])
        async with AsyncHttpSender(running.url, secrets=[SECRET]) as send:
            summary = await Dispatcher(queue, send, owner="d1").run(until_empty=True)
    assert summary.done == 3
    await until(lambda: sink_state(sink_db)[0] == 6)


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Tenant", "acme\r\nX-Evil: 1")],
        [("X-Tenant", "acme\nX-Evil: 1")],
        [("X-Evil\r\nHost", "x")],
        [("Host", "internal.example")],
        [("webhook-signature", "v1,forged")],
        [("X-Asnackq-Token", "999")],
        [("Content-Type", "text/plain")],
        [("X-Tenant", "caf\u00e9")],
        [("X-A", "1"), ("x-a", "2")],
        [(f"X-{i}", "v") for i in range(17)],
    ],
    ids=["crlf", "lf", "name-crlf", "host", "signature", "token", "content-type", "non-ascii",
         "twice", "too-many"],
)  # fmt: skip
def test_an_endpoints_header_that_could_inject_or_override_is_refused(headers) -> None:
    for sender in (HttpSender, AsyncHttpSender):
        with pytest.raises(ValueError) as refused:
            sender("http://127.0.0.1:9/x", headers=headers)
        assert "\n" not in str(refused.value) and "X-Evil: 1" not in str(refused.value)


async def test_an_endpoints_headers_are_sent_and_the_senders_own_win() -> None:
    with receiver() as server:
        async with AsyncHttpSender(
            server.url, success="2xx", secrets=[SECRET], headers={"X-Tenant": "acme"}
        ) as send:
            assert await send(EVENT, 3) is True
    [seen] = server.seen
    assert seen["x-tenant"] == "acme" and seen["content-type"] == "application/json"
    assert seen["x-asnackq-token"] == "3" and server.refused == 0
