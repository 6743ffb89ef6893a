"""Attacks on the attempt records (asnackq_attempts) found by review."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.wire import webhooks
from asnackq.wire.send import AsyncHttpSender

from .test_attempt_records import BREAKER, deliver, kept


@pytest.mark.parametrize("where", ["sqlite", "postgresql"])
async def test_an_answer_holding_a_nul_byte_is_kept_and_the_run_goes_on(
    where: str, db: Path, pg_db
) -> None:
    """A receiver's body with a NUL byte must not stop the run (PostgreSQL's text holds no
    NUL: the cycle's INSERT failed and the Dispatcher stopped) nor cut the record short
    (SQLite's ``->>`` ended the text at the NUL): the job is done and the record whole."""
    target = str(db) if where == "sqlite" else pg_db()
    await deliver(target, [(200, b"ok\x00tail", {})])
    [row] = kept(target)
    assert row[3] == 200 and row[5] == "ok"
    assert row[6] == "ok\ufffdtail"


async def test_an_unreadable_answer_s_record_shows_no_request_header(db: Path, caplog) -> None:
    """An answer aiohttp cannot parse was kept (and logged) as the repr of aiohttp's error,
    which holds every header of the request: the Authorization made of a URL's userinfo, the
    signature. The record says what went wrong, and nothing of the request."""
    answers = [b"garbage\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n"]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answers.pop(0) if len(answers) > 1 else answers[0])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret = webhooks.new_secret()
    async with server, AsyncQueue.open(db) as queue:
        await queue.enqueue_many([({"id": "j1", "qty": 1}, 60_000, 3)])
        url = f"http://alice:s3cretpw@127.0.0.1:{port}/events"
        async with AsyncHttpSender(url, success="2xx", secrets=[secret]) as send:
            summary = await Dispatcher(
                queue, send, owner="d1", concurrency=1, breaker=BREAKER, keep_attempts=True
            ).run(until_empty=True)
    assert summary.done == 1
    first, last = kept(db)
    assert (first[3], first[5], last[3], last[5]) == (None, "away", 204, "ok")
    assert "Bad status line" in first[6] or "garbage" in first[6], first[6]
    for text in (first[6], caplog.text):
        for hidden in ("s3cretpw", "YWxpY2U6czNjcmV0cHc", "Authorization", "webhook-signature"):
            assert hidden not in text, (hidden, text)
