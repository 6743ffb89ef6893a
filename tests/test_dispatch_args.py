"""``Dispatcher(...)`` refuses what it could not run, naming the argument: before any job."""

from __future__ import annotations

import functools
from collections.abc import Awaitable

import pytest

from asnackq.aio import AsyncQueue, Dispatcher

from .conftest import job


async def two(event, token):
    return True


async def one(event):
    return True


async def keyword_token(event, *, token):
    return True


class AsyncCall:
    async def __call__(self, event, token=None):
        return True


class SyncCall:
    def __call__(self, event, token):
        return True


def annotated(event: object, token: object) -> Awaitable[bool]:
    return two(event, token)


@pytest.mark.parametrize(
    "send", [two, AsyncCall(), functools.partial(two), annotated, AsyncCall().__call__]
)
async def test_an_async_send_taking_event_and_token_is_accepted(db, send):
    async with AsyncQueue.open(db) as q:
        assert Dispatcher(q, send, owner="d1").send is send


@pytest.mark.parametrize(
    ("send", "message"),
    [
        (one, r"send must accept \(event, token\) positionally; its signature is \(event\)"),
        (keyword_token, r"send must accept \(event, token\) positionally"),
        (lambda event, token: True, r"send must be async \(async def, or an object with an"),
        (SyncCall(), r"send must be async"),
        (print, r"send must be async"),
        ("http://127.0.0.1/events", r"send must be callable"),
    ],
)
async def test_a_send_it_could_not_await_is_refused_by_name(db, send, message):
    async with AsyncQueue.open(db, clock=lambda: 1_700_000_000_000) as q:
        await q.enqueue({"id": "a", "qty": 1})
        with pytest.raises(ValueError, match=message):
            Dispatcher(q, send, owner="d1")
    assert job(db, "a")["status"] == "pending"  # refused before any job


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency": 0}, r"concurrency must be an int in 1\.\.1024: 0"),
        ({"lease_ms": 3_600_001}, r"lease_ms must be an int in 1\.\.3600000: 3600001"),
        ({"gather_ms": 1001}, r"gather_ms must be an int in 0\.\.1000: 1001"),
        ({"grace_s": -1}, r"grace_s must be a number of seconds in 0\.\.3600: -1"),
        ({"owner": "a b"}, r"owner must be 1-64 ASCII letters"),
        ({"clock": 3}, r"clock must be callable: 3"),
    ],
)
async def test_wrong_types_and_ranges_name_the_argument_and_its_range(db, options, message):
    async with AsyncQueue.open(db) as q:
        with pytest.raises(ValueError, match=message):
            Dispatcher(q, two, **{"owner": "d1", **options})
