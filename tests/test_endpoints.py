"""A queue's endpoints: every call on a file and on PostgreSQL, every refusal changing nothing,
the audit of each change (never a secret in it), rotation, and the commands as processes."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import endpoints as ep
from asnackq.core.endpoints import Delays, Endpoint, EndpointExists, Exponential, NoSuchEndpoint
from asnackq.core.receivers import fingerprint
from asnackq.store.targets import is_url
from asnackq.wire import webhooks as wh

from . import pgdb
from .conftest import T0
from .test_cli import asnackq

SECRET = wh.new_secret()
OTHER = wh.new_secret()
CREDENTIAL = "Bearer s3cr3t-header-value"
URL = "http://127.0.0.1:8080/hooks"


@pytest.fixture(params=["file", pytest.param("pg", marks=pytest.mark.process)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new queue: a file, or a PostgreSQL database."""
    if request.param == "pg":
        url: str = request.getfixturevalue("pg_db")()
        return url
    return str(tmp_path / "queue.db")


def snapshot(where: str) -> list[Any]:
    """Both tables' rows, read through a separate connection (absent tables: none)."""
    found: list[Any] = []
    for table in ("asnackq_endpoints", "asnackq_endpoint_changes"):
        if is_url(where):
            if pgdb.query(where, "SELECT to_regclass(%s) IS NOT NULL", (table,))[0][0]:
                found += [table, *pgdb.query(where, f"SELECT * FROM {table} ORDER BY 1")]
            continue
        con = sqlite3.connect(where)
        try:
            if con.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (table,)).fetchone():
                found += [table, *con.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()]
        finally:
            con.close()
    return found


def orders(**changes: Any) -> Endpoint:
    settings: dict[str, Any] = {
        "types": ("order.paid", "refund.*"),
        "secrets": (SECRET,),
        "headers": {"X-Env": "prod", "Authorization": CREDENTIAL},
    }
    return Endpoint(**({"name": "orders", "url": URL} | settings | changes))


def no_secret_in(text: str) -> None:
    for secret in (SECRET, OTHER, CREDENTIAL):
        assert secret not in text
        assert secret.removeprefix("whsec_")[:12] not in text


async def test_every_call_and_its_audit(where: str) -> None:
    async with AsyncQueue.open(where) as q:
        assert await q.endpoints() == [] and await q.endpoint_changes() == []
        added = await q.add_endpoint(orders(), now_ms=T0)
        assert added.created_ms == added.updated_ms == T0 and added.enabled
        assert added.secrets == ((SECRET, None),) and added.retry == Delays()
        assert await q.endpoint("orders") == added
        before = snapshot(where)
        with pytest.raises(EndpointExists, match="'orders' exists already"):
            await q.add_endpoint(orders(url="http://127.0.0.1:9/other"), now_ms=T0 + 1)
        assert snapshot(where) == before
        second = await q.add_endpoint(Endpoint("audit-log", "https://localhost/in"), now_ms=T0)
        assert [e.name for e in await q.endpoints()] == ["audit-log", "orders"]

        changed = await q.update_endpoint(
            "orders", now_ms=T0 + 1, timeout_s=30, retry=Exponential(500, 60_000), rate=5.0, burst=2
        )
        assert (changed.timeout_s, changed.rate, changed.burst) == (30.0, 5.0, 2)
        assert changed.updated_ms == T0 + 1 and changed.created_ms == T0
        same = snapshot(where)
        assert await q.update_endpoint("orders", now_ms=T0 + 2, timeout_s=30) == changed
        assert snapshot(where) == same  # nothing changed: nothing written, no audit row

        rotated = await q.rotate_secret("orders", OTHER, overlap_s=3600, now_ms=T0 + 3)
        assert rotated.secrets == ((OTHER, None), (SECRET, T0 + 3 + 3_600_000))
        assert await q.disable_endpoint("orders", "gone: answered 410", now_ms=T0 + 4) is True
        assert await q.disable_endpoint("orders", "again", now_ms=T0 + 5) is False
        gone = await q.endpoint("orders")
        assert (gone.state, gone.disabled_reason, gone.disabled_at_ms) == (
            "disabled",
            "gone: answered 410",
            T0 + 4,
        )
        assert await q.enable_endpoint("orders", now_ms=T0 + 6) is True
        assert await q.enable_endpoint("orders", now_ms=T0 + 7) is False
        enabled = await q.endpoint("orders")
        assert enabled.disabled_reason is None and enabled.secrets == rotated.secrets
        assert await q.remove_endpoint("orders", now_ms=T0 + 8) == enabled
        assert await q.endpoints() == [second]

        for call in (
            q.endpoint("orders"),
            q.update_endpoint("orders", timeout_s=5),
            q.rotate_secret("orders", SECRET),
            q.disable_endpoint("orders", "x"),
            q.enable_endpoint("orders"),
            q.remove_endpoint("orders"),
        ):
            final = snapshot(where)
            with pytest.raises(NoSuchEndpoint, match="no endpoint 'orders'"):
                await call
            assert snapshot(where) == final

        changes = await q.endpoint_changes("orders")
        assert [c.action for c in changes] == [
            "remove",
            "enable",
            "disable",
            "rotate",
            "update",
            "add",
        ]
        assert [c.at_ms for c in changes] == [T0 + 8, T0 + 6, T0 + 4, T0 + 3, T0 + 1, T0]
        assert changes[2].note == "gone: answered 410"
        assert "timeout_s 15.0 -> 30.0" in changes[4].note
        assert f"{fingerprint(OTHER)} signs from now" in changes[3].note
        assert "Authorization" in changes[5].note
        no_secret_in(repr(snapshot(where)[snapshot(where).index("asnackq_endpoint_changes") :]))
        no_secret_in(repr(rotated))


# Each refused change: the field, the value, and what the refusal says.
REFUSED = [
    ("url", "ftp://127.0.0.1/x", "http"),
    ("url", "http://127.0.0.1:0/x", "port"),
    ("url", "http://127.0.0.1:99999/x", "port"),
    ("url", "http:///nohost", "HOST"),
    ("url", "http://example.com/x", "non-loopback"),
    ("url", "http://user:pw@127.0.0.1/x", "user or password"),
    ("url", "http://127.0.0.1/x\r\nHost: evil", "visible ASCII"),
    ("url", "http://127.0.0.1/" + "a" * 3000, "visible ASCII"),
    ("url", 7, "visible ASCII"),
    ("types", ("order..paid",), "event type"),
    ("types", ("*",), "event type"),
    ("types", ("order.*.paid",), "event type"),
    ("types", "order.paid", "tuple or list"),
    ("types", ("a",) * 2, "twice"),
    ("types", tuple(f"t{i}" for i in range(65)), "at most 64"),
    ("secrets", ("not-a-secret",), "whsec_"),
    ("secrets", ("whsec_" + "QUJD" * 4,), "24-64 bytes"),
    ("secrets", ((SECRET, T0),), "newest secret"),
    ("secrets", (SECRET, SECRET), "twice"),
    ("secrets", SECRET, "tuple or list"),
    ("rate", 0.0, "rate"),
    ("rate", float("nan"), "rate"),
    ("rate", "5", "rate"),
    ("burst", 10**9, "burst"),
    ("burst", True, "burst"),
    ("concurrency", 0, "concurrency"),
    ("concurrency", 2000, "concurrency"),
    ("concurrency", "max", "concurrency"),
    ("timeout_s", 0, "timeout_s"),
    ("timeout_s", 601, "timeout_s"),
    ("timeout_s", True, "timeout_s"),
    ("retry", (0, 5000), "Exponential"),
    ("retry", "auto", "Exponential"),
    ("success", "3xx", "success"),
    ("ordered", 1, "ordered"),
    ("headers", {"X-A": "b\r\nEvil: 1"}, "control characters"),
    ("headers", {"X-A": "line\nbreak"}, "control characters"),
    ("headers", {"X A": "b"}, "HTTP token"),
    ("headers", {"X-A\r\nEvil": "b"}, "HTTP token"),
    ("headers", {"Content-Type": "text/plain"}, "set by the sender"),
    ("headers", {"host": "evil.example"}, "set by the sender"),
    ("headers", {"Webhook-Signature": "v1,x"}, "set by the sender"),
    ("headers", {"X-Asnackq-Token": "1"}, "set by the sender"),
    ("headers", {"Transfer-Encoding": "chunked"}, "set by the sender"),
    ("headers", {"X-A": "x" * 2000}, "at most 1024"),
    ("headers", {f"X-{i}": "v" for i in range(17)}, "at most 16"),
    ("headers", [("X-A", "1"), ("x-a", "2")], "twice"),
    ("name", "x", "changes url, types"),
    ("state", "disabled", "changes url, types"),
]


@pytest.mark.parametrize(
    ("key", "value", "says"), REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)]
)
async def test_a_refused_update_changes_nothing(
    where: str, key: str, value: Any, says: str
) -> None:
    async with AsyncQueue.open(where) as q:
        await q.add_endpoint(orders(), now_ms=T0)
        before = snapshot(where)
        with pytest.raises(ValueError, match=None) as refused:
            await q.update_endpoint("orders", **{key: value})
        assert says in str(refused.value) and "\n" not in str(refused.value)
        no_secret_in(str(refused.value))
        assert snapshot(where) == before


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"name": "bad name"}, "endpoint name"),
        ({"name": "x" * 65}, "endpoint name"),
        ({"burst": 5}, "burst needs a rate"),
        ({"state": "paused"}, "state"),
        ({"state": "disabled"}, "reason"),
        ({"disabled_reason": "why"}, "enabled endpoint"),
        ({"created_ms": -1}, "created_ms"),
    ],
)
def test_an_endpoint_is_checked_whole(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=None) as refused:
        orders(**changes)
    assert says in str(refused.value)
    no_secret_in(str(refused.value))


@pytest.mark.parametrize(
    "delays", [(), tuple(range(33)), (8 * 86_400_000,), (-1,), (1.5,), [0, 1]], ids=str
)
def test_a_retry_schedule_is_checked(delays: Any) -> None:
    with pytest.raises(ValueError, match="retry delay"):
        Delays(delays)
    for base, cap in ((0, 10), (10, 5), (1, 8 * 86_400_000), (True, 5)):
        with pytest.raises(ValueError, match="retry"):
            Exponential(base, cap)


async def test_other_refusals_change_nothing(where: str) -> None:
    async with AsyncQueue.open(where) as q:
        await q.add_endpoint(orders(), now_ms=T0)
        before = snapshot(where)
        refusals = [
            (q.add_endpoint(orders(name="far", url="https://example.com/x")), "non-loopback"),
            (q.add_endpoint(orders(name="other").__dict__), "an Endpoint"),  # type: ignore[arg-type]
            (q.rotate_secret("orders", "whsec_short"), "whsec_"),
            (q.rotate_secret("orders", OTHER, overlap_s=-1), "overlap_s"),
            (q.rotate_secret("orders", OTHER, overlap_s=31 * 86_400), "overlap_s"),
            (q.disable_endpoint("orders", ""), "reason"),
            (q.disable_endpoint("orders", "two\nlines"), "reason"),
            (q.disable_endpoint("orders", "x" * 201), "reason"),
            (q.update_endpoint("bad name", timeout_s=3), "endpoint name"),
            (q.endpoint_changes("orders", limit=0), "limit"),
        ]
        for call, says in refusals:
            with pytest.raises(ValueError, match=says):
                await call
        assert snapshot(where) == before
        far = await q.add_endpoint(
            orders(name="far", url="https://example.com/x"), allow_remote=True, now_ms=T0
        )
        assert far.url == "https://example.com/x"


async def test_a_rotation_keeps_the_old_secrets_signing_for_the_overlap(where: str) -> None:
    third = wh.new_secret()
    async with AsyncQueue.open(where) as q:
        await q.add_endpoint(orders(), now_ms=T0)
        first = await q.rotate_secret("orders", OTHER, now_ms=T0)  # the default: 24 h
        until = T0 + 86_400_000
        assert first.secrets == ((OTHER, None), (SECRET, until))
        ring = wh.Keyring.of_ms(first.secrets)
        assert ring.keys(now_s=(until - 1) / 1000) == [
            wh.parse_secret(OTHER),
            wh.parse_secret(SECRET),
        ]
        assert ring.keys(now_s=until / 1000) == [wh.parse_secret(OTHER)]
        # later: the first secret's end passed and it is dropped; OTHER signs 60 s more
        later = await q.rotate_secret("orders", third, overlap_s=60, now_ms=until)
        assert later.secrets == ((third, None), (OTHER, until + 60_000))
        assert (await q.endpoint("orders")).secrets == later.secrets
        note = (await q.endpoint_changes("orders", limit=1))[0].note
        assert (
            note
            == f"{fingerprint(third)} signs from now; {fingerprint(OTHER)} until {until + 60_000}"
        )


async def test_a_row_out_of_range_is_one_line_without_its_secret(tmp_path: Path) -> None:
    where = str(tmp_path / "queue.db")
    async with AsyncQueue.open(where) as q:
        await q.add_endpoint(orders(), now_ms=T0)
    con = sqlite3.connect(where)
    con.execute("UPDATE asnackq_endpoints SET secrets = ?", (json.dumps([[SECRET, T0]]),))
    con.commit()
    con.close()
    async with AsyncQueue.open(where) as q:
        with pytest.raises(ValueError, match="the endpoint row 'orders' is out of range") as bad:
            await q.endpoints()
    no_secret_in(str(bad.value))


def test_durations_read_and_written() -> None:
    assert [ep.parse_duration(t) for t in ("250ms", "5s", "5m", "2h", "1d")] == [
        250,
        5000,
        300_000,
        7_200_000,
        86_400_000,
    ]
    assert [ep.duration(ms) for ms in (0, 1500, 5000, 300_000, 36_000_000)] == [
        "0s",
        "1500ms",
        "5s",
        "5m",
        "10h",
    ]
    for bad in ("5", "5 s", "-1s", "1w", "s"):
        with pytest.raises(ValueError, match="a duration"):
            ep.parse_duration(bad)


# --- the commands, as processes --------------------------------------------------------


def cli(*args: str, code: int = 0) -> Any:
    done = asnackq(*args)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    if code:
        assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
        return done.stderr
    return json.loads(done.stdout) if "--json" in args else done.stdout


@pytest.mark.process
@pytest.mark.timeout(300)  # (a dozen CLI processes: on a busy machine, minutes)
def test_the_commands_show_a_new_secret_once(where: str, tmp_path: Path) -> None:
    cli("init", where)
    added = cli(
        "endpoint", "add", where, "orders", "--url", URL, "--types", "order.paid,refund.*",
        "--new-secret", "--header", f"Authorization: {CREDENTIAL}", "--header", "X-Env: prod",
        "--retry-delays", "0,5s,5m,30m,2h,5h,10h,10h", "--concurrency", "8", "--json",
    )  # fmt: skip
    secret = added["secret"]
    assert wh.parse_secret(secret) and added["endpoint"]["secrets"] == [
        {"fingerprint": fingerprint(secret), "until": None, "until_ms": None}
    ]
    assert added["endpoint"]["retry"] == {"delays_ms": list(ep.DEFAULT_DELAYS_MS)}
    outputs = [
        cli("endpoint", "list", where),
        json.dumps(cli("endpoint", "list", where, "--json")),
        cli("endpoint", "show", where, "orders"),
        cli("endpoint", "update", where, "orders", "--timeout-s", "30", "--rate", "5"),
        cli("endpoint", "rotate-secret", where, "orders", "--secret-file", secret_file(tmp_path)),
        cli("endpoint", "disable", where, "orders", "--reason", "gone: answered 410"),
        cli("endpoint", "enable", where, "orders"),
        cli("endpoint", "changes", where, "orders", "--json"),
        json.dumps(cli("endpoint", "show", where, "orders", "--json")),
        repr(snapshot(where)[snapshot(where).index("asnackq_endpoint_changes") :]),
    ]
    for output in outputs:
        assert secret not in output and CREDENTIAL not in output and OTHER not in output
    shown = cli("endpoint", "show", where, "orders", "--json")
    assert shown["endpoint"]["headers"] == [
        {"name": "Authorization", "value": None, "chars": len(CREDENTIAL)},
        {"name": "X-Env", "value": "prod"},
    ]
    assert [c["action"] for c in shown["changes"]] == [
        "enable",
        "disable",
        "rotate",
        "update",
        "add",
    ]
    assert [s["fingerprint"] for s in shown["endpoint"]["secrets"]] == [
        fingerprint(OTHER),
        fingerprint(secret),
    ]
    assert cli("endpoint", "remove", where, "orders", "--json") == {"removed": "orders"}
    assert cli("endpoint", "list", where, "--json") == {"endpoints": []}


def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "next.secret"
    path.write_text(f"# the next one\n{OTHER}\n")
    return str(path)


@pytest.mark.process
@pytest.mark.timeout(300)  # (some thirty CLI processes: on a busy machine, minutes)
def test_bad_input_is_a_usage_line_and_writes_nothing(where: str, tmp_path: Path) -> None:
    cli("init", where)
    cli("endpoint", "add", where, "orders", "--url", URL)
    before = snapshot(where)
    data = None if is_url(where) else Path(where).read_bytes()
    bad_file = tmp_path / "bad.secret"
    bad_file.write_text("whsec_tooshort\n")
    for args in [
        ("add", where, "other", "--url", "http://example.com/x"),
        ("add", where, "other", "--url", "ftp://127.0.0.1/x"),
        ("add", where, "bad name", "--url", URL),
        ("add", where, "other", "--url", URL, "--header", "X-A: b\r\nEvil: 1"),
        ("add", where, "other", "--url", URL, "--header", "Host: evil"),
        ("add", where, "other", "--url", URL, "--header", "no colon"),
        ("add", where, "other", "--url", URL, "--types", "a..b"),
        ("add", where, "other", "--url", URL, "--retry-delays", "5s,1w"),
        ("add", where, "other", "--url", URL, "--retry-delays", "5s", "--retry-base-ms", "5"),
        ("add", where, "other", "--url", URL, "--retry-base-ms", "5"),
        ("add", where, "other", "--url", URL, "--secret-file", str(bad_file)),
        ("add", where, "other", "--url", URL, "--concurrency", "0"),
        ("add", where, "other", "--url", URL, "--rate", "fast"),
        ("add", where, "other", "--url", URL, "--burst", "3"),
        ("add", where, "other", "--url", URL, "--timeout-s", "700"),
        ("add", where, "other", "--url", URL, "--timeout-s", "1e-9"),  # (times every send out)
        ("update", where, "orders", "--timeout-s", "0.0009"),
        ("update", where, "orders"),
        ("update", where, "orders", "--url", "http://example.com/x"),
        ("rotate-secret", where, "orders"),
        ("rotate-secret", where, "orders", "--secret-file", str(bad_file)),
        ("disable", where, "orders", "--reason", "two\nlines"),
    ]:
        said = cli("endpoint", *args, code=2)
        assert "whsec_tooshort" not in said
    assert "--allow-remote" in cli(
        "endpoint", "add", where, "x", "--url", "http://example.com/", code=2
    )
    assert "exists already" in cli("endpoint", "add", where, "orders", "--url", URL, code=1)
    assert "no endpoint 'nope'" in cli("endpoint", "enable", where, "nope", code=1)
    assert "no queue" in cli("endpoint", "list", str(tmp_path / "none.db"), code=1)
    assert snapshot(where) == before
    if data is not None:
        assert Path(where).read_bytes() == data
