"""Attacks on a worker sending to a named endpoint (asnackq.dispatch.endpoint)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from psycopg.conninfo import conninfo_to_dict

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.dispatch.endpoint import Disabled, EndpointSend

from . import pgdb
from .test_webhook_senders import SECRET, Receiver, ReceiverHandler, receiver

FAST = BreakerPolicy(after=1, base_ms=20, max_ms=100)


def send_to(queue: AsyncQueue, name: str, refresh_s: float = 0.0, **options) -> EndpointSend:
    return EndpointSend(
        name,
        read=lambda: queue.endpoint(name),
        disable=lambda reason: queue.disable_endpoint(name, reason),
        refresh_s=refresh_s,
        **options,
    )


def end_sessions(url: str) -> int:
    """pg_terminate_backend every other session of ``url``'s database (a server restart,
    as the queue's sessions see it)."""
    name = conninfo_to_dict(url)["dbname"]
    rows = pgdb.query(
        url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = %s AND pid <> pg_backend_pid()",
        (name,),
    )
    return len(rows)


async def test_a_lost_database_session_while_the_row_is_read_is_no_send_error(pg_db) -> None:
    url = pg_db()
    with receiver() as server:
        async with AsyncQueue.open(url) as queue:
            await queue.add_endpoint(Endpoint("partner", server.url, secrets=(SECRET,)))
            async with send_to(queue, "partner") as send:
                assert await send({"id": "a", "qty": 1}, 1) is True
                assert end_sessions(url) >= 1
                try:
                    answer = await send({"id": "b", "qty": 1}, 1)
                except w.Unavailable:
                    answer = "unavailable"
                assert answer in (True, "unavailable")


class Hooked(Receiver):
    """A receiver calling ``hook()`` before its first answer."""

    def __init__(self, hook) -> None:
        super().__init__(SECRET)
        self.hook = hook
        self.RequestHandlerClass = HookedHandler


class HookedHandler(ReceiverHandler):
    server: Hooked

    def do_POST(self) -> None:
        hook, self.server.hook = self.server.hook, None
        if hook is not None:
            hook()
        super().do_POST()


async def test_a_database_outage_while_the_row_is_read_abandons_no_job(pg_db, pg_server) -> None:
    """The first request is answered 503 and the queue's database goes away (its sessions
    ended, new ones refused) for 2 s: the job's re-send reads the row during the outage. A
    sink's worker sends on through an outage; an endpoint's must too (the row as last read),
    not count an error and abandon the job until its lease ends."""
    url = pg_db()
    name = conninfo_to_dict(url)["dbname"]
    admin = pg_server.url()

    def outage() -> None:
        pgdb.query(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        pgdb.query(
            admin,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (name,),
        )
        server.status = 503
        threading.Timer(0.05, lambda: setattr(server, "status", 204)).start()
        threading.Timer(
            2.0, lambda: pgdb.query(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        ).start()

    server = Hooked(outage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        async with AsyncQueue.open(url) as queue:
            await queue.add_endpoint(Endpoint("partner", server.url, secrets=(SECRET,)))
            await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(3)])
            async with send_to(queue, "partner") as send:
                dispatcher = Dispatcher(
                    queue, send, owner="d1", concurrency=1, lease_ms=5000, breaker=FAST
                )
                summary = await dispatcher.run()
    finally:
        server.shutdown()
        server.server_close()
    assert summary.done == 3 and summary.db_outages >= 1
    assert (summary.errors, summary.claimed) == (0, 3)


async def test_a_url_the_worker_refuses_is_sent_nothing_nor_is_the_url_before(tmp_path) -> None:
    """The row's URL changed (by an operator allowed remote hosts) to one this worker, not
    allowed them, refuses: nothing is sent, no send fails as an error (a ValueError: the
    job abandoned), and the URL the row no longer names is sent nothing either; the row
    changed back, sends resume."""
    with receiver() as old:
        async with AsyncQueue.open(tmp_path / "q.db") as queue:
            await queue.add_endpoint(Endpoint("partner", old.url, secrets=(SECRET,)))
            async with send_to(queue, "partner", refresh_s=0.2) as send:
                assert await send({"id": "a", "qty": 1}, 1) is True
                await queue.update_endpoint(
                    "partner", url="http://10.1.2.3:9/hook", allow_remote=True
                )
                await asyncio.sleep(0.25)
                for token in (2, 3, 4):
                    with pytest.raises(Disabled, match="refused by this worker"):
                        await send({"id": "b", "qty": 1}, token)
                assert len(old.seen) == 1  # the replaced URL: nothing more
                await queue.update_endpoint("partner", url=old.url)
                await asyncio.sleep(0.25)
                assert await send({"id": "b", "qty": 1}, 5) is True
    assert len(old.seen) == 2 and old.refused == 0
