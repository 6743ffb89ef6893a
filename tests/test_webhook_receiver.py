"""The example receiver (examples/webhook_receiver.py) as a real process: deliveries signed
by the official standardwebhooks library and by asnackq's, each sent several times, the
receiver SIGKILLed mid-run and started again, everything sent again: each payment applied
exactly once, as the service's own tables show."""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from standardwebhooks.webhooks import Webhook

from asnackq.wire import webhooks as wh

EXAMPLE = Path(__file__).parents[1] / "examples" / "webhook_receiver.py"
OLD, NEW = wh.new_secret(), wh.new_secret()  # the receiver holds both: a rotation


async def start(db: Path, secrets: Path) -> tuple[asyncio.subprocess.Process, str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        "--db",
        str(db),
        "--port",
        "0",
        "--secret-file",
        str(secrets),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    line = (await asyncio.wait_for(child.stdout.readline(), 30)).decode()
    assert line.startswith("listening on "), line
    return child, line.split()[-1]


def headers(n: int, msg_id: str, body: bytes) -> dict[str, str]:
    """A fresh signature for each attempt: the official library's, or asnackq's."""
    if n % 2:
        now = datetime.datetime.now(datetime.UTC)
        signed = {"webhook-id": msg_id, "webhook-timestamp": str(int(now.timestamp()))}
        signed["webhook-signature"] = Webhook(OLD).sign(msg_id, now, body)
    else:
        signed = wh.signed_headers([wh.parse_secret(NEW)], msg_id, body)
    return {**signed, "Content-Type": "application/json"}


async def send(
    session: aiohttp.ClientSession, url: str, n: int, delivery: tuple[str, bytes]
) -> tuple[int, Any] | None:
    """One attempt; None when the connection failed (the receiver was killed)."""
    msg_id, body = delivery
    try:
        async with session.post(url, data=body, headers=headers(n, msg_id, body)) as answer:
            return answer.status, await answer.json()
    except (TimeoutError, aiohttp.ClientError):
        return None


def deliveries(count: int) -> list[tuple[str, bytes]]:
    rng = random.Random(7)
    return [
        (f"pay-{i}", json.dumps({"account": f"a-{i % 5}", "amount": rng.randint(1, 90)}).encode())
        for i in range(count)
    ]


async def send_all(
    url: str,
    attempts: list[tuple[str, bytes]],
    kill_after: int | None,
    child: asyncio.subprocess.Process,
) -> list[tuple[int, Any] | None]:
    """Every attempt, 8 at a time; SIGKILL ``child`` once ``kill_after`` answers arrived."""
    answered, gate, killed = 0, asyncio.Semaphore(8), False
    timeout = aiohttp.ClientTimeout(total=15)

    async def one(session: aiohttp.ClientSession, n: int) -> tuple[int, Any] | None:
        nonlocal answered, killed
        async with gate:
            found = await send(session, url, n, attempts[n])
        answered += found is not None
        if kill_after is not None and answered >= kill_after and not killed:
            child.send_signal(signal.SIGKILL)  # requests still in flight
            killed = True
        return found

    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one(session, n) for n in range(len(attempts))))


@pytest.mark.process
async def test_each_payment_is_applied_once_across_resends_and_a_sigkill(tmp_path):
    db, secrets = tmp_path / "pay.db", tmp_path / "secrets.txt"
    secrets.write_text(f"# the current secret, then the one it replaces\n{NEW}\n{OLD}\n")
    sent = deliveries(60)
    attempts = sent * 3
    random.Random(1).shuffle(attempts)
    child, url = await start(db, secrets)
    try:
        first = await send_all(url, attempts, kill_after=50, child=child)
        assert await asyncio.wait_for(child.wait(), 30) == -signal.SIGKILL
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert 50 <= sum(found is not None for found in first) < len(attempts)
    child, url = await start(db, secrets)
    try:
        again = await send_all(url, attempts + sent, kill_after=None, child=child)
        async with aiohttp.ClientSession() as session:
            msg_id, body = sent[0]
            conflict = await send(session, url, 0, (msg_id, body.replace(b"}", b', "x": 1}')))
            long_list = headers(0, "pay-x", body)
            long_list["webhook-signature"] = " ".join([long_list["webhook-signature"]] * 1000)
            async with session.post(url, data=body, headers=long_list) as answer:
                refused = answer.status
    finally:
        child.send_signal(signal.SIGTERM)
        assert child.stderr is not None
        stderr = (await asyncio.wait_for(child.stderr.read(), 30)).decode()
        assert await asyncio.wait_for(child.wait(), 30) == 0
    assert {found[0] for found in again if found is not None} == {200}
    assert all(found is not None for found in again)
    assert conflict is not None and conflict[0] == 409 and refused == 400
    assert "Traceback" not in stderr and all(
        line.startswith("webhook_receiver: ") for line in stderr.splitlines()
    )
    with sqlite3.connect(db) as con:
        payments = con.execute("SELECT event_id, account, amount FROM payments").fetchall()
        balances = dict(con.execute("SELECT id, balance FROM accounts").fetchall())
        inbox = con.execute(
            "SELECT count(*), sum(deliveries) FROM asnackq_webhook_inbox"
        ).fetchone()
    con.close()
    expected = {msg_id: json.loads(body) for msg_id, body in sent}
    assert sorted(p[0] for p in payments) == sorted(expected)  # each payment once, none lost
    assert all((a, m) == (expected[i]["account"], expected[i]["amount"]) for i, a, m in payments)
    totals: dict[str, int] = {}
    for event in expected.values():
        totals[event["account"]] = totals.get(event["account"], 0) + event["amount"]
    assert balances == totals
    assert inbox[0] == 60 and inbox[1] >= 60 * 4  # every attempt after the restart counted
