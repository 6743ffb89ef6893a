"""``asnackq lab --endpoints``: events fanned out to receiver processes of their own, each
with its fault, served by ``asnackq work QUEUE`` processes (SIGKILLed and replaced with
``--kill-every``, the queue on a file or on PostgreSQL); the verdicts per endpoint find no
violation when the product holds, and do fail when a receiver applies twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from asnackq.aio import AsyncQueue
from asnackq.core.endpoints import Endpoint
from asnackq.lab.fanout import Receiver, in_order, parse_fault
from asnackq.wire import webhooks as wh

from .conftest import asnackq_cli

JSON = {"Content-Type": "application/json"}
WAIT_S = 400  # a bound on the whole lab run: generous, for a busy machine
EVERY_FAULT = {
    "ep1": "503:0.5",
    "ep2": "slow:200",
    "ep3": "410:5",
    "ep4": "down:0.5:2",
    "ep5": "429:0.3",
}


async def lab(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, object]]:
    out_file = tmp_path / "result.json"
    code, out, err = await asnackq_cli(
        "lab", "--dir", str(tmp_path / "run"), "--json", str(out_file), "--timeout-s", "300",
        *args, wait_s=WAIT_S,
    )  # fmt: skip
    assert "Traceback" not in err, err
    return code, out, json.loads(out_file.read_text()) if out_file.exists() else {}


@pytest.mark.process
@pytest.mark.timeout(300)  # (a whole lab: on a busy machine, minutes)
async def test_a_lab_run_with_every_endpoint_fault_finds_no_violation(tmp_path: Path) -> None:
    faults = [f"--endpoint-fault={name}:{fault}" for name, fault in EVERY_FAULT.items()]
    code, out, result = await lab(
        tmp_path, "--endpoints", "6", "--jobs", "60", "--healthy-bound-s", "60", *faults,
        "--endpoint-ordered", "ep0", "--endpoint-ordered", "ep1",
    )  # fmt: skip
    assert code == 0, out
    assert result["violations"] == []
    endpoints = result["endpoints"]
    assert isinstance(endpoints, dict)
    for name, found in endpoints.items():
        assert found["nothing-lost"] is True and found["applied-once"] is True, name
    assert endpoints["ep0"]["healthy-bound"] is True and endpoints["ep0"]["fault"] is None
    assert endpoints["ep0"]["in-order"] is True and endpoints["ep1"]["in-order"] is True
    assert endpoints["ep3"]["gone-reenabled"] is True  # disabled by its 410, enabled again
    assert endpoints["ep4"]["deliveries"] == {"done": 60}  # every one despite its SIGKILL
    done = {(e["endpoint"], e["what"]) for e in result["lab_events"]}  # type: ignore[attr-defined]
    assert {("ep4", "killed"), ("ep4", "restarted"), ("ep3", "enabled")} <= done
    assert ("ep3", "disabled: gone: answered 410") in done


@pytest.mark.process
async def test_a_receiver_that_applies_twice_fails_the_applied_once_verdict(
    tmp_path: Path,
) -> None:
    code, out, result = await lab(
        tmp_path, "--endpoints", "2", "--jobs", "20", "--endpoint-fault", "ep1:twice"
    )
    assert code == 1
    assert result["violations"] == ["ep1: applied-once: 20 deliveries applied more than once"]
    assert "VIOLATION ep1: applied-once" in out


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--endpoints", "2", "--endpoint-fault", "ep2:slow:10"], "no endpoint 'ep2'"),
        (["--endpoints", "2", "--endpoint-fault", "ep0:boom"], "NAME:KIND[:ARG]"),
        (["--endpoint-fault", "ep0:slow:10"], "need --endpoints"),
        (["--endpoints", "2", "--sinks", "2"], "--sinks: one sink's, not with --endpoints"),
        (["--endpoints", "2", "--db", "q.db"], "--db must be a postgresql:// URL"),
    ],
)
async def test_bad_endpoint_options_are_one_line_and_start_nothing(
    tmp_path: Path, args: list[str], said: str
) -> None:
    code, out, err = await asnackq_cli("lab", "--dir", str(tmp_path / "run"), *args)
    assert code == 2 and out == ""
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.process
@pytest.mark.timeout(WAIT_S + 60)
async def test_a_lab_run_on_postgresql_with_worker_kills_finds_no_violation(
    tmp_path: Path, pg_db: Callable[[], str]
) -> None:
    """Workers SIGKILLed every second (each after it has served that long) and replaced,
    while ep3 is down for 8 s: every endpoint's deliveries applied once, in order on ep1,
    within the bound (wide: a busy machine restarts workers slowly).  Small: each kill
    costs a Python start and a lease of waiting."""
    code, out, result = await lab(
        tmp_path, "--endpoints", "4", "--jobs", "40", "--db", pg_db(), "--kill-every", "1",
        "--endpoint-ordered", "ep1", "--endpoint-fault", "ep2:503:0.3",
        "--endpoint-fault", "ep3:down:1:8", "--healthy-bound-s", "240",
    )  # fmt: skip
    assert code == 0, (out, result.get("violations"), result.get("kills"))
    assert result["violations"] == []
    assert result["kills"] >= 1 and result["workers_started"] == 2 + result["kills"]
    endpoints = result["endpoints"]
    assert isinstance(endpoints, dict)
    for name, found in endpoints.items():
        assert found["deliveries"] == {"done": 40}, name
        assert found["applied_rows"] == 40 and found["applied-once"] is True, name
    assert endpoints["ep1"]["in-order"] is True
    assert endpoints["ep0"]["healthy-bound"] is True and endpoints["ep1"]["healthy-bound"] is True


@pytest.mark.process
async def test_a_database_with_endpoints_already_is_refused_and_nothing_starts(
    tmp_path: Path, pg_db: Callable[[], str]
) -> None:
    url = pg_db()
    async with AsyncQueue.open(url) as queue:
        await queue.add_endpoint(Endpoint("theirs", "http://127.0.0.1:9/hook"))
    code, out, err = await asnackq_cli("lab", "--dir", str(tmp_path / "run"), "--endpoints",
                                       "2", "--db", url)  # fmt: skip
    assert code == 2 and out == ""
    assert "--db must hold no endpoints yet (1 there)" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_order_verdict_names_an_event_applied_after_a_later_one_of_its_key() -> None:
    rows = [("e0", "k0", 0, 1), ("e1", "k1", 1, 2), ("e2", "k0", 2, 3)]
    assert in_order(rows) is True
    assert (
        in_order([rows[2], rows[1], rows[0]])
        == "e0 (key k0) applied after a later event of its key"
    )


def test_a_fault_is_name_kind_and_arguments() -> None:
    assert parse_fault("ep3:down:1.5:2") == ("ep3", "down:1.5:2")
    for bad in ("ep0:503:1", "ep0:slow", "ep0", "e p:slow:1", "ep0:410:x"):
        with pytest.raises(ValueError, match="endpoint"):
            parse_fault(bad)


@pytest.mark.process
async def test_a_lab_receiver_takes_its_secret_from_a_file_never_its_command_line(
    tmp_path: Path,
) -> None:
    """Another user's ``ps`` shows a process's arguments: the secret is not among them."""
    receiver = Receiver("ep0", tmp_path / "ep0.db", wh.new_secret(), "none", 1)
    await receiver.start()
    try:
        assert receiver.process is not None
        argv = await asyncio.to_thread(Path(f"/proc/{receiver.process.pid}/cmdline").read_bytes)
        body = json.dumps({"data": {"key": "k", "n": 1}}).encode()
        headers = wh.signed_headers([wh.parse_secret(receiver.secret)], "ev-1", body)
        async with (
            aiohttp.ClientSession() as session,
            session.post(receiver.url, data=body, headers=headers | JSON) as answer,
        ):
            said = await answer.json()
        assert (answer.status, said) == (200, {"id": "ev-1", "status": "applied"})
    finally:
        await receiver.stop()
    assert receiver.secret[6:].encode() not in argv and receiver.secret[6:] not in repr(receiver)
