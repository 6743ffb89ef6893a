"""The receiving library (``WebhookReceiver``) on an application's own aiosqlite and psycopg
connections, served by a real aiohttp server on 127.0.0.1: each webhook-id's effect once
ever, every refusal one line with nothing applied; and ``asnackq sink --secret-file``."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import re
import runpy
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import aiosqlite
import psycopg
import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook

from asnackq.aio import AsyncQueue
from asnackq.cli import main
from asnackq.http_sink import WebhookReceiver
from asnackq.sink.receiver import Rejected
from asnackq.store.turns import turn
from asnackq.wire import webhooks as wh
from asnackq.wire.logs import OneLine

from .sinks import serving, sink, sink_state

SECRET, OTHER = wh.new_secret(), wh.new_secret()
KEY = wh.parse_secret(SECRET)
KINDS = ["sqlite", pytest.param("pg", marks=pytest.mark.process)]
Effect = Callable[[Any, str, Any], Awaitable[None]]


class App:
    """The application's connection, its ``ledger`` table, and a receiver served on it."""

    def __init__(self, con: Any, kind: str) -> None:
        self.con, self.kind = con, kind
        self.url = ""
        self.receiver: WebhookReceiver[Any] | None = None

    def sql(self, text: str) -> str:
        return text if self.kind == "sqlite" else text.replace("?", "%s")

    async def rows(self, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        async with turn(self.con):  # (the application's own reads take the connection's turn)
            if self.kind == "sqlite":
                return [tuple(r) for r in await self.con.execute_fetchall(text, params)]
            return list(await (await self.con.execute(self.sql(text), params)).fetchall())

    async def effect(self, con: Any, event_id: str, payload: Any) -> None:
        """The application's effect: one ledger row per payment."""
        await con.execute(self.sql("INSERT INTO ledger VALUES (?, ?)"), (event_id, payload["n"]))

    async def ledger(self) -> list[tuple[Any, ...]]:
        return await self.rows("SELECT id, n FROM ledger ORDER BY id")

    async def inbox(self) -> list[tuple[Any, ...]]:
        return await self.rows(
            "SELECT id, deliveries, first_token, last_token FROM asnackq_webhook_inbox ORDER BY id"
        )


@pytest.fixture(params=KINDS)
async def app_con(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[App]:
    if request.param == "sqlite":
        async with aiosqlite.connect(tmp_path / "app.db", isolation_level=None) as db:
            await db.execute("CREATE TABLE ledger (id TEXT, n INTEGER)")
            yield App(db, "sqlite")
        return
    url = request.getfixturevalue("pg_db")()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as con:
        await con.execute("CREATE TABLE ledger (id TEXT, n INTEGER)")
        yield App(con, "pg")


@pytest.fixture
async def app(app_con: App) -> AsyncIterator[App]:
    """The receiver at ``app.url``, with ``app.effect`` as its effect."""
    async with receiving(app_con, app_con.effect) as running:
        yield running


def receiving(app: App, effect: Effect, **options: Any) -> Any:
    async def serve() -> AsyncIterator[App]:
        receiver = await WebhookReceiver.within(app.con, [OTHER, SECRET], effect, **options)
        web_app = web.Application()
        web_app.router.add_post("/hooks", receiver.handle)
        async with serving(web_app) as running:
            app.url, app.receiver = f"{running.base}/hooks", receiver
            yield app

    return contextlib.asynccontextmanager(serve)()


def body(n: int, **more: Any) -> bytes:
    return json.dumps({"n": n, **more}).encode()


def signed(msg_id: str, data: bytes, token: int | None = None, **headers: str) -> dict[str, str]:
    found = {**wh.signed_headers([KEY], msg_id, data), "Content-Type": "application/json"}
    if token is not None:
        found["X-Asnackq-Token"] = str(token)
    return {**found, **headers}


async def post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as answer,
    ):
        text = await answer.text()
        return answer.status, json.loads(text) if text.startswith("{") else text


async def test_a_first_delivery_applies_a_repeat_is_a_duplicate_other_content_a_conflict(app):
    data = body(5)
    official = Webhook(SECRET).sign("d-1", datetime.datetime.now(datetime.UTC), data)
    by_library = {"webhook-timestamp": str(int(time.time()))}
    by_library |= {"webhook-id": "d-1", "webhook-signature": official}
    answers = [
        await post(app.url, data, {**by_library, "Content-Type": "application/json"}),
        await post(app.url, data, signed("d-1", data, token=2)),
        await post(app.url, data, signed("d-1", data, token=3)),
        await post(app.url, body(6), signed("d-1", body(6), token=4)),
    ]
    assert answers == [
        (200, {"id": "d-1", "status": "applied"}),
        (200, {"id": "d-1", "status": "duplicate"}),
        (200, {"id": "d-1", "status": "duplicate"}),
        (409, {"id": "d-1", "status": "conflict"}),
    ]
    assert await app.ledger() == [("d-1", 5)]
    assert await app.inbox() == [("d-1", 3, None, 3)]  # the conflict changed nothing
    assert app.receiver.counts == {
        "applied": 1,
        "duplicates": 2,
        "conflicts": 1,
        "refused": 0,
        "rejected": 0,
        "failed": 0,
        "unavailable": 0,
    }


def bad_signatures() -> list[tuple[str, dict[str, str], str]]:
    """(case, headers, reason) for one body: each must be a 401 with nothing applied."""
    data, now = body(1), time.time()
    good = signed("x-1", data)
    long_entries = " ".join([good["webhook-signature"]] * 1000)  # 1,000 entries, over 8 KiB
    return [
        (
            "wrong key",
            signed("x-1", data)
            | wh.signed_headers([wh.parse_secret(wh.new_secret())], "x-1", data),
            "no webhook-signature entry matches",
        ),
        (
            "expired",
            signed("x-1", data) | wh.signed_headers([KEY], "x-1", data, now - 600),
            "too old",
        ),
        (
            "future",
            signed("x-1", data) | wh.signed_headers([KEY], "x-1", data, now + 600),
            "too far in the future",
        ),
        ("1,000 entries", good | {"webhook-signature": " ".join(["v1,x"] * 1000)}, "more than 16"),
        ("1,000 long entries", good | {"webhook-signature": long_entries}, ""),
        ("no id", {k: v for k, v in good.items() if k != "webhook-id"}, "are required"),
        (
            "no timestamp",
            {k: v for k, v in good.items() if k != "webhook-timestamp"},
            "are required",
        ),
        (
            "no signature",
            {k: v for k, v in good.items() if k != "webhook-signature"},
            "are required",
        ),
        ("another body", signed("x-1", body(2)), "no webhook-signature entry matches"),
        ("another id", good | {"webhook-id": "x-2"}, "no webhook-signature entry matches"),
    ]


async def test_every_bad_signature_is_one_line_401_and_applies_nothing(app, caplog):
    caplog.set_level(logging.INFO)
    for case, headers, reason in bad_signatures():
        status, answer = await post(app.url, body(1), headers)
        if reason:
            assert (status, answer["status"]) == (401, "unauthorized"), case
            assert reason in answer["error"] and "\n" not in answer["error"], case
        else:  # a header line over aiohttp's 8190 bytes: its parser's 400, before any handler
            assert status == 400, case
    assert await app.ledger() == [] and await app.inbox() == []
    assert app.receiver.counts["refused"] == 9
    for record in caplog.records:  # each one line, as a one-line formatter writes it
        line = OneLine("app").format(record)
        assert "\n" not in line and "Traceback" not in line
        assert SECRET[6:] not in line and OTHER[6:] not in line
        assert record.name == "aiohttp.server" or record.exc_info is None


async def test_a_body_too_big_not_json_or_of_another_type_is_refused_and_applies_nothing(app_con):
    async with receiving(app_con, app_con.effect, max_body=1024) as app:
        big = body(1, pad="x" * 2000)
        cases = [
            (413, big, signed("b-1", big)),
            (415, body(1), signed("b-2", body(1), **{"Content-Type": "text/plain"})),
            (400, b"{not json", signed("b-3", b"{not json")),
            (400, b'{"n": 1, "n": 2}', signed("b-4", b'{"n": 1, "n": 2}')),  # a key twice
            (400, body(1), signed("b-5", body(1), **{"X-Asnackq-Token": "0x1"})),
            (400, b'{"n": 1e999}', signed("b-7", b'{"n": 1e999}')),  # infinity: not JSON
            (400, b'{"n": "\\ud800"}', signed("b-8", b'{"n": "\\ud800"}')),  # not text
        ]
        for status, data, headers in cases:
            found, answer = await post(app.url, data, headers)
            assert (found, "\n" in answer["error"]) == (status, False), answer

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read past the limit
            for _ in range(4):
                yield b" " * 512

        async with (
            aiohttp.ClientSession() as session,
            session.post(app.url, data=chunks(), headers=signed("b-6", b" " * 2048)) as answer,
        ):
            assert answer.status == 413
        assert await app.ledger() == [] and await app.inbox() == []
        assert app.receiver.counts["refused"] == 8


async def test_an_effect_that_raises_applies_nothing_and_the_next_attempt_applies_once(
    app_con, caplog
):
    failures = [RuntimeError("password=hunter2")]

    async def effect(con: Any, event_id: str, payload: Any) -> None:
        await app_con.effect(con, event_id, payload)  # written, then rolled back
        if failures:
            raise failures.pop()

    async with receiving(app_con, effect) as app:
        found = [await post(app.url, body(7), signed("e-1", body(7))) for _ in range(3)]
        assert [status for status, _ in found] == [500, 200, 200]
        assert [answer["status"] for _, answer in found] == ["failed", "applied", "duplicate"]
        assert "hunter2" not in json.dumps(found[0]) and "hunter2" not in caplog.text
        assert "RuntimeError" in caplog.text
        assert await app.ledger() == [("e-1", 7)]
        assert await app.inbox() == [("e-1", 2, None, None)]


async def test_a_rejected_payload_is_422_and_leaves_no_trace(app_con):
    async def effect(con: Any, event_id: str, payload: Any) -> None:
        await app_con.effect(con, event_id, payload)
        raise Rejected("n must be even")

    async with receiving(app_con, effect) as app:
        for _ in range(2):
            status, answer = await post(app.url, body(3), signed("r-1", body(3)))
            assert (status, answer) == (
                422,
                {"id": "r-1", "status": "rejected", "error": "n must be even"},
            )
        assert await app.ledger() == [] and await app.inbox() == []


async def test_concurrent_deliveries_of_one_id_apply_once(app):
    data = body(9)
    found = await asyncio.gather(*(post(app.url, data, signed("c-1", data)) for _ in range(20)))
    statuses = sorted(answer["status"] for _, answer in found)
    assert statuses == ["applied"] + ["duplicate"] * 19
    assert await app.ledger() == [("c-1", 9)]
    assert await app.inbox() == [("c-1", 20, None, None)]


@contextlib.asynccontextmanager
async def replicas(url: str) -> AsyncIterator[tuple[App, App]]:
    """Two applications on one PostgreSQL database (its ledger made once)."""
    async with (
        await psycopg.AsyncConnection.connect(url, autocommit=True) as one,
        await psycopg.AsyncConnection.connect(url, autocommit=True) as two,
    ):
        await one.execute("CREATE TABLE ledger (id TEXT, n INTEGER)")
        yield App(one, "pg"), App(two, "pg")


@pytest.mark.process
async def test_two_connections_to_one_database_apply_each_id_once(pg_db):
    async with replicas(pg_db()) as (first, second):
        async with receiving(first, first.effect), receiving(second, second.effect):
            sends = [
                post(app.url, body(n % 5), signed(f"p-{n % 5}", body(n % 5)))
                for n in range(40)
                for app in (first, second)
            ]
            found = await asyncio.gather(*sends)
        statuses = [answer["status"] for _, answer in found]
        assert (statuses.count("applied"), statuses.count("duplicate")) == (5, 75)
        assert await first.ledger() == [(f"p-{n}", n) for n in range(5)]
        assert [row[:2] for row in await second.inbox()] == [(f"p-{n}", 16) for n in range(5)]


async def test_an_effect_may_enqueue_on_the_same_connection_and_the_job_commits_with_it(tmp_path):
    async with aiosqlite.connect(tmp_path / "app.db", isolation_level=None) as db:
        await db.execute("CREATE TABLE ledger (id TEXT, n INTEGER)")
        queue = await AsyncQueue.within(db)
        app = App(db, "sqlite")
        fail = [True]

        async def effect(con: Any, event_id: str, payload: Any) -> None:
            await queue.enqueue({"id": f"ship-{event_id}", "qty": payload["n"]})
            if fail:  # the first time: the job is rolled back with the inbox row
                raise RuntimeError(str(fail.pop()))

        async with receiving(app, effect):
            for expected in (500, 200, 200):
                found, _ = await post(app.url, body(2), signed("q-1", body(2)))
                assert found == expected
        jobs = await db.execute_fetchall("SELECT id, qty, status FROM jobs")
        assert [tuple(job) for job in jobs] == [("ship-q-1", 2, "pending")]


async def test_a_connection_left_in_a_transaction_is_503_and_nothing_is_applied(tmp_path):
    async with aiosqlite.connect(tmp_path / "app.db", isolation_level=None) as db:
        await db.execute("CREATE TABLE ledger (id TEXT, n INTEGER)")
        app = App(db, "sqlite")
        async with receiving(app, app.effect):
            await db.execute("BEGIN")  # the application's transaction, left open
            found, answer = await post(app.url, body(1), signed("t-1", body(1)))
            assert (found, answer["status"]) == (503, "unavailable")
            await db.execute("ROLLBACK")
            found, answer = await post(app.url, body(1), signed("t-1", body(1)))
            assert (found, answer["status"]) == (200, "applied")


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"secrets": []}, "give 1-16 secrets"),
        ({"secrets": "whsec_abc"}, "a list"),
        ({"secrets": [SECRET, "whsec_" + SECRET[6:10]]}, "secret 2"),
        ({"tolerance_s": 0}, "tolerance_s"),
        ({"max_body": 2 * 1024 * 1024}, "max_body"),
        ({"body_timeout_s": 0}, "body_timeout_s"),
        ({"effect": "not callable"}, "effect"),
    ],
)
async def test_bad_arguments_are_refused_before_anything_is_created(tmp_path, options, why):
    async with aiosqlite.connect(tmp_path / "app.db", isolation_level=None) as db:
        arguments = {"secrets": [SECRET], "effect": App(db, "sqlite").effect, **options}
        secrets, effect = arguments.pop("secrets"), arguments.pop("effect")
        with pytest.raises(ValueError, match=why) as refused:
            await WebhookReceiver.within(db, secrets, effect, **arguments)
        assert SECRET[6:] not in str(refused.value)
        assert await db.execute_fetchall("SELECT name FROM sqlite_master") == []
    with pytest.raises(ValueError, match=r"aiosqlite\.Connection or psycopg\.AsyncConnection"):
        await WebhookReceiver.within(object(), [SECRET], App(db, "sqlite").effect)


async def test_the_receiver_never_shows_a_secret(tmp_path):
    async with aiosqlite.connect(tmp_path / "app.db", isolation_level=None) as db:
        receiver = await WebhookReceiver.within(db, [SECRET], App(db, "sqlite").effect)
        assert SECRET[6:] not in repr(receiver.signatures) and "keys" not in repr(
            receiver.signatures
        )


# --- asnackq sink --secret-file -------------------------------------------------------------


async def test_a_sink_with_secrets_applies_signed_events_and_refuses_the_rest(tmp_path):
    db = tmp_path / "sink.db"
    event = json.dumps({"id": "s-1", "qty": 4}).encode()
    async with sink(db, secrets=(OTHER, SECRET)) as running:
        cases = [
            signed("s-1", event),
            {"Content-Type": "application/json"},  # unsigned
            signed("s-1", event)
            | wh.signed_headers([wh.parse_secret(wh.new_secret())], "s-1", event),
            signed("s-1", event) | wh.signed_headers([KEY], "s-1", event, time.time() - 600),
            signed("s-1", event),
        ]
        found = [await post(running.url, event, headers) for headers in cases]
    assert [status for status, _ in found] == [200, 401, 401, 401, 200]
    assert [answer["status"] for _, answer in found] == [
        "applied",
        "unauthorized",
        "unauthorized",
        "unauthorized",
        "duplicate",
    ]
    assert sink_state(db) == (4, [("s-1", 4, 2)])


async def test_a_sink_refuses_a_signed_event_whose_webhook_id_is_not_its_id(tmp_path):
    """The webhook-id is what the signature vouches for and what a receiver dedupes on: an
    event whose body names another id is refused, whatever its signature, and applies
    nothing."""
    db = tmp_path / "sink.db"
    event = json.dumps({"id": "s-1", "qty": 4}).encode()
    async with sink(db, secrets=(SECRET,)) as running:
        found = [await post(running.url, event, signed(msg_id, event)) for msg_id in ("s-2", "x")]
        applied = await post(running.url, event, signed("s-1", event))
    assert [status for status, _ in found] == [400, 400]
    assert all("webhook-id" in answer["error"] for _, answer in found)
    assert applied == (200, {"id": "s-1", "status": "applied"})
    assert sink_state(db) == (4, [("s-1", 4, 1)])


def test_a_bad_secret_file_is_a_usage_error_that_creates_nothing(tmp_path, capsys):
    db = tmp_path / "sink.db"
    files = {"missing": tmp_path / "none.txt", "bad": tmp_path / "bad.txt"}
    files["bad"].write_text(f"# rotation\n{SECRET}\nwhsec_hunter2\n")
    for name, path in files.items():
        with pytest.raises(SystemExit) as ended:
            main(["sink", "--db", str(db), "--secret-file", str(path)])
        assert ended.value.code == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--secret-file" in err, err
        assert "hunter2" not in err and SECRET[6:] not in err
    assert "line 3" in err
    assert not db.exists()


# --- docs/sink.md's receiving application, as written ----------------------------------------


async def test_the_pages_receiving_application_runs_as_written(tmp_path, monkeypatch):
    """The page's program, run in a fresh directory with a secrets file: a signed payment is
    applied once, a repeat is a duplicate, a payload it refuses a 422, an unsigned one a 401."""
    page = (Path(__file__).parents[1] / "docs" / "sink.md").read_text()
    (source,) = re.findall(r"^```python\n(.*?)^```$", page, flags=re.M | re.S)
    (tmp_path / "program.py").write_text(source)
    (tmp_path / "secrets.txt").write_text(f"{SECRET}\n")
    monkeypatch.chdir(tmp_path)
    program = runpy.run_path(str(tmp_path / "program.py"), run_name="the_page")
    paid, odd = json.dumps({"amount": 5}).encode(), json.dumps({"amount": "5"}).encode()
    async with serving(program["app"]) as running:
        url = f"{running.base}/webhooks"
        found = [
            await post(url, paid, signed("pay-1", paid)),
            await post(url, paid, signed("pay-1", paid)),
            await post(url, odd, signed("pay-2", odd)),
            await post(url, paid, {"Content-Type": "application/json"}),
        ]
    assert [(status, answer["status"]) for status, answer in found] == [
        (200, "applied"),
        (200, "duplicate"),
        (422, "rejected"),
        (401, "unauthorized"),
    ]
    async with aiosqlite.connect(tmp_path / "pay.db") as db:
        assert await db.execute_fetchall("SELECT * FROM payments") == [("pay-1", 5)]
