"""A worker sending to one of its queue's named endpoints: the row says where and how
(URL, success rule, timeout, secrets, headers); a rotation signs from the next send; a
disabled endpoint is sent nothing; a 410 disables it; enabling it resumes, no attempt
spent meanwhile. Receivers are Python's http.server verifying with the official
Standard Webhooks library."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint, NoSuchEndpoint
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.dispatch.endpoint import GONE_REASON, Disabled, EndpointSend
from asnackq.wire import webhooks as wh

from .conftest import job
from .sequencer import until
from .test_webhook_senders import SECRET, receiver
from .test_webhook_senders import run_cli as cli

FAST = BreakerPolicy(after=1, base_ms=20, max_ms=100)


def send_to(queue: AsyncQueue, name: str, refresh_s: float = 0.0) -> EndpointSend:
    return EndpointSend(
        name,
        read=lambda: queue.endpoint(name),
        disable=lambda reason: queue.disable_endpoint(name, reason),
        refresh_s=refresh_s,
    )


async def fill(queue: AsyncQueue, count: int, prefix: str = "j") -> None:
    await queue.enqueue_many([({"id": f"{prefix}{i}", "qty": 1}, 60_000, 3) for i in range(count)])


async def test_the_rows_url_rule_secrets_and_headers_are_what_is_sent(db: Path) -> None:
    with receiver() as server:
        partner = Endpoint(
            "partner", server.url, secrets=(SECRET,), headers=(("X-Tenant", "acme 7"),)
        )
        async with AsyncQueue.open(db) as queue:
            await queue.add_endpoint(partner)
            await fill(queue, 5)
            async with send_to(queue, "partner") as send:
                summary = await Dispatcher(queue, send, owner="d1", concurrency=2).run()
    assert summary.done == 5 and server.refused == 0 and len(server.seen) == 5
    assert {h["x-tenant"] for h in server.seen} == {"acme 7"}
    assert {h["webhook-id"] for h in server.seen} == {f"j{i}" for i in range(5)}


async def test_a_rotation_signs_from_the_next_send_with_both_secrets(db: Path) -> None:
    new = wh.new_secret()
    with receiver(new) as only_new:
        async with AsyncQueue.open(db) as queue:
            await queue.add_endpoint(Endpoint("partner", only_new.url, secrets=(SECRET,)))
            await fill(queue, 1, "before")
            async with send_to(queue, "partner") as send:
                with pytest.raises(w.BadAck, match="401"):  # signed with the old one only
                    await send({"id": "before0", "qty": 1}, 1)
                await queue.rotate_secret("partner", new, overlap_s=3600)
                assert await send({"id": "after", "qty": 1}, 1) is True
    assert only_new.refused == 1
    assert only_new.seen[-1]["webhook-signature"].count("v1,") == 2  # new, and old for 1 h


async def test_410_disables_the_endpoint_nothing_is_sent_until_enabled_and_no_attempt_spent(
    db: Path,
) -> None:
    with receiver() as server:
        server.status = 410
        async with AsyncQueue.open(db) as queue:
            await queue.add_endpoint(Endpoint("partner", server.url, secrets=(SECRET,)))
            await fill(queue, 3)
            async with send_to(queue, "partner") as send:
                dispatcher = Dispatcher(
                    queue, send, owner="d1", concurrency=3, lease_ms=2000, breaker=FAST
                )
                run = asyncio.ensure_future(dispatcher.run())
                try:
                    await until(lambda: dispatcher.snapshot()["probes"] >= 1, 30)
                    row = await queue.endpoint("partner")
                    assert (row.state, row.disabled_reason) == ("disabled", GONE_REASON)
                    sent = len(server.seen)
                    probes = dispatcher.snapshot()["probes"]
                    await until(lambda: dispatcher.snapshot()["probes"] >= probes + 5, 60)
                    assert len(server.seen) == sent  # probes meet the row, never the receiver
                    server.status = 204
                    assert await queue.enable_endpoint("partner")
                    summary = await asyncio.wait_for(run, 60)
                finally:
                    run.cancel()
            changes = [c.action for c in await queue.endpoint_changes("partner")]
    assert summary.done == 3
    for i in range(3):  # the 410s and the wait spent no attempt
        row = job(db, f"j{i}")
        assert row is not None and (row["status"], row["attempts"]) == ("done", 1)
    assert changes[:2] == ["enable", "disable"]  # newest first


async def test_a_removed_or_disabled_endpoint_is_sent_nothing(db: Path) -> None:
    with receiver() as server:
        async with AsyncQueue.open(db) as queue:
            await queue.add_endpoint(Endpoint("partner", server.url))
            async with send_to(queue, "partner") as send:
                await queue.disable_endpoint("partner", "paused by an operator")
                with pytest.raises(Disabled, match="paused by an operator"):
                    await send({"id": "a", "qty": 1}, 1)
                await queue.remove_endpoint("partner")
                with pytest.raises(Disabled, match="removed"):
                    await send({"id": "a", "qty": 1}, 1)
            with pytest.raises(NoSuchEndpoint):
                async with send_to(queue, "partner"):
                    pass
    assert server.seen == []


@pytest.mark.process
def test_work_endpoint_delivers_signed_to_a_204_receiver(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    with receiver() as server:

        async def setup() -> None:
            async with AsyncQueue.open(db) as queue:
                await queue.add_endpoint(Endpoint("partner", server.url, secrets=(SECRET,)))
                await queue.enqueue_many([{"id": f"e{i}", "data": {"n": i}} for i in range(4)])
                await fill(queue, 2)  # the contract's jobs: no endpoint's, never sent here

        asyncio.run(setup())
        done = cli("work", str(db), "--endpoint", "partner", "--until-empty", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done"] == 4 and server.refused == 0
    assert sorted(h["webhook-id"] for h in server.seen) == [f"e{i}" for i in range(4)]
    assert [job(db, f"j{i}")["status"] for i in range(2)] == ["pending", "pending"]  # type: ignore[index]
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.process
@pytest.mark.parametrize(
    ("extra", "code", "says"),
    [
        (["--success", "2xx"], 2, "--success: with --endpoint, the endpoint's row says"),
        (["--timeout-s", "3"], 2, "--timeout-s: with --endpoint"),
        (["--secret-file", "/nonexistent"], 2, "--secret-file: with --endpoint"),
        (["--sink", "http://127.0.0.1:9/x"], 2, "not allowed with argument"),
        ([], 1, "no endpoint 'nobody'"),
    ],
)
def test_work_endpoint_refusals_are_one_line(tmp_path: Path, extra, code, says) -> None:
    db = tmp_path / "q.db"
    assert cli("init", str(db)).returncode == 0
    refused = cli("work", str(db), "--endpoint", "nobody", "--until-empty", *extra)
    assert refused.returncode == code, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], refused.stderr


async def test_the_address_guard_takes_the_endpoints_allowed_networks_beside_the_workers(
    db: Path,
) -> None:
    """A worker allowed remote hosts refuses a name resolving to a loopback address, unless
    the endpoint (or the worker) allows that network; nothing reaches the receiver before."""
    with receiver() as server:
        port = server.server_address[1]
        url = f"http://hooks.example:{port}/hook"
        lookup = lambda host, port: ["127.0.0.1"]  # noqa: E731 (a resolver stub)
        async with AsyncQueue.open(db) as queue:
            await queue.add_endpoint(Endpoint("partner", url, secrets=(SECRET,)), allow_remote=True)
            guarded = EndpointSend(
                "partner",
                read=lambda: queue.endpoint("partner"),
                disable=lambda reason: queue.disable_endpoint("partner", reason),
                refresh_s=0.0,
                allow_remote=True,
                lookup=lookup,
            )
            async with guarded as send:
                with pytest.raises(w.Permanent, match="loopback"):
                    await send({"id": "a", "qty": 1}, 1)
                assert server.seen == []
                await queue.update_endpoint(
                    "partner", allow_networks=("127.0.0.0/8",), allow_remote=True
                )
                assert await send({"id": "a", "qty": 1}, 2) is True
            assert (await queue.endpoint("partner")).allow_networks == ("127.0.0.0/8",)
    assert len(server.seen) == 1 and server.refused == 0


@pytest.mark.parametrize("bad", [("10.0.0.1/8",), ("not-a-net",), (8,), ("10.0.0.0/8",) * 17])
def test_an_endpoints_allowed_networks_are_checked(bad) -> None:
    with pytest.raises(ValueError, match="allow_networks"):
        Endpoint("partner", "http://127.0.0.1:9/x", allow_networks=bad)


@pytest.mark.process
def test_endpoint_add_and_update_take_allowed_networks(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    assert cli("init", str(db)).returncode == 0
    added = cli(
        "endpoint", "add", str(db), "partner", "--url", "http://10.1.2.3:8080/hooks",
        "--allow-remote", "--allow-network", "10.1.0.0/16", "--json",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["endpoint"]["allow_networks"] == ["10.1.0.0/16"]
    bad = cli("endpoint", "update", str(db), "partner", "--allow-network", "10.1.2.3/16")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    cleared = cli("endpoint", "update", str(db), "partner", "--no-allow-networks", "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cleared.stdout)["endpoint"]["allow_networks"] == []


async def test_an_endpoint_changed_often_keeps_three_senders_open_at_most(db: Path) -> None:
    with receiver(secret=None) as server:
        async with AsyncQueue.open(db) as queue:
            await queue.add_endpoint(Endpoint("partner", server.url))
            async with send_to(queue, "partner") as send:
                for timeout_s in (3.0, 4.0, 5.0, 6.0, 7.0):
                    await queue.update_endpoint("partner", timeout_s=timeout_s)
                    assert await send({"id": "a", "qty": 1}, 1) is True
                    assert len(send.senders) <= 3
                assert send.sender is not None and send.sender.timeout_s == 7.0
    assert len(server.seen) == 5
