"""Attacks on the webhook receiver (``WebhookReceiver``) found by review."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from .test_receiving import App, app_con, body, post, receiving, signed

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
