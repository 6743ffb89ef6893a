"""Attacks on the webhook receiver (``WebhookReceiver``) found by review."""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from asnackq.http_sink import WebhookReceiver, expect_continue

from .test_receiving import SECRET, App, app_con, body, post, receiving, signed

__all__ = ["app_con"]


@pytest.mark.parametrize("statement", ["SELECT * FROM no_such_table", "ROLLBACK"])
async def test_an_effect_that_leaves_the_transaction_unable_to_commit_is_never_an_applied(
    app_con: App, statement: str
) -> None:
    """An effect that swallows a failed statement (PostgreSQL: the transaction is aborted)
    or rolls back itself: nothing was committed, so the answer must not be 200 applied (a
    sender would never send it again and the effect is lost)."""

    async def effect(con: Any, event_id: str, payload: Any) -> None:
        await app_con.effect(con, event_id, payload)
        with contextlib.suppress(Exception):  # (a "did we have it already?" done wrong)
            await con.execute(statement)

    async with receiving(app_con, effect) as app:
        status, answer = await post(app.url, body(5), signed("t-1", body(5)))
        ledger, inbox = await app.ledger(), await app.inbox()
    if (status, answer["status"]) == (200, "applied"):  # (SQLite: the failed SELECT is harmless)
        assert (app_con.kind, ledger, inbox) == ("sqlite", [("t-1", 5)], [("t-1", 1, None, None)])
    else:  # refused at COMMIT: nothing kept, so the sender's next attempt applies it
        assert (status, answer["status"], ledger, inbox) == (503, "unavailable", [], [])


async def test_a_token_header_of_thousands_of_digits_is_the_token_s_own_refusal(
    app_con: App,
) -> None:
    """``X-Asnackq-Token`` of 5,000 digits was answered with Python's own message ("Exceeds
    the limit (4300 digits) for integer string conversion ... sys.set_int_max_str_digits()")
    instead of the header's rule."""
    async with receiving(app_con, app_con.effect) as app:
        headers = signed("k-1", body(1), **{"X-Asnackq-Token": "9" * 5000})
        status, answer = await post(app.url, body(1), headers)
    assert (status, answer["error"]) == (400, "X-Asnackq-Token must be an int in 1..10**15")


@contextlib.asynccontextmanager
async def served_as_apps_do(app: App, **options: Any) -> AsyncIterator[tuple[str, int]]:
    """The receiver on an application's own server: aiohttp's defaults (it inflates
    compressed bodies itself), with a lingering drain long enough to see (an hour)."""
    receiver = await WebhookReceiver.within(app.con, [SECRET], app.effect, **options)
    web_app = web.Application()
    web_app.router.add_post("/hooks", receiver.handle, expect_handler=expect_continue)
    runner = web.AppRunner(web_app, access_log=None, lingering_time=3600)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield "127.0.0.1", runner.addresses[0][1]
    finally:
        await runner.cleanup()


def bomb(size: int) -> bytes:
    """``size`` zero bytes, gzipped (about a thousandth of that)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return packer.compress(bytes(size)) + packer.flush()


@pytest.mark.parametrize(
    "case", ["inflates past max_body", "declared past max_body", "not application/json"]
)
async def test_a_refusal_before_the_body_is_whole_closes_the_connection_undrained(
    app_con: App, case: str
) -> None:
    """On an application's server (aiohttp's defaults) a body refused before it was whole
    was drained after the answer - and a compressed one inflated on the event loop: four
    gzip bombs of 4 MB held an ordinary delivery for 13 s.  The refusal now ends the
    connection at once; the part of the body still unsent is never awaited."""
    data = bomb(64 * 1024 * 1024)  # 64 MiB inflated
    head = data[: len(data) // 2]  # half sent: the rest never comes
    headers = {**signed("b-1", b"{}"), "Content-Encoding": "gzip"}
    length = len(data)
    if case == "declared past max_body":
        head, length = b"", 10**12
    elif case == "not application/json":  # (a body within max_body, half sent)
        head, length = head[:400], 800
        headers["Content-Type"] = "text/plain"
    async with served_as_apps_do(app_con, max_body=1024) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            start = f"POST /hooks HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
            writer.write(f"{start}{lines}\r\n".encode() + head)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 30)  # (to the connection's end)
        finally:
            writer.close()
    status = 415 if case == "not application/json" else 413
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["status"]
    assert await app_con.ledger() == [] and await app_con.inbox() == []


@pytest.mark.parametrize(
    ("expect", "status"), [(b"\xff", 417), (b"x", 417), (b"100-continue", 200)]
)
async def test_an_expect_header_is_refused_in_one_json_line_or_continued(
    app_con: App, expect: bytes, status: int
) -> None:
    """aiohttp's own expect handler echoes the header: ``Expect: \\xff`` was a ``500`` and
    a traceback in the application's log."""
    data = body(1)
    async with served_as_apps_do(app_con) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            lines = "".join(f"{k}: {v}\r\n" for k, v in signed("e-1", data).items())
            start = f"POST /hooks HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
            writer.write(f"{start}{lines}".encode() + b"Expect: " + expect + b"\r\n\r\n")
            if status == 200:  # (the body once told to go on)
                assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30) == (
                    b"HTTP/1.1 100 Continue\r\n\r\n"
                )
            writer.write(data)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        finally:
            writer.close()
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
    assert await app_con.ledger() == ([("e-1", 1)] if status == 200 else [])
