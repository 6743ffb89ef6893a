"""Many claimers on one PostgreSQL database: 4 processes x 8 coroutines, each on its own
session, two sink replicas, stalls beyond the lease and abandoned leases.

Every claim and every finish is recorded with the clock reading it used (one clock for all
processes: this machine's), then the evidence is checked: no job held by two leases at
once, tokens strictly increasing per job, a finish accepted only on the lease it names,
every job done once, each effect applied once, the inbox and the stock in agreement.
"""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.lab.procs import PIPE, sink_process, sink_stats, start, stop
from asnackq.store import pg

from .pgdb import query
from .sinks import sink_state

LEASE_MS = 400
WORKER = """
import asyncio, json, random, sys
from asnackq.core.worker import epoch_ms
from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.wire.send import AsyncHttpSender

async def coroutine(url, sink, name, out, rng, lease_ms):
    async with AsyncQueue.open(url) as queue, AsyncHttpSender(sink, timeout_s=5) as send:
        idle = 0
        while idle * 50 < 2 * lease_ms:  # (an abandoned lease ends before all stop)
            now = epoch_ms()
            if rng.random() < 0.5:
                tickets = await queue.claim_many(name, now, lease_ms, rng.randint(1, 4))
            else:
                tickets = [t for t in [await queue.claim(name, now, lease_ms)] if t]
            if not tickets:
                idle += 1
                await asyncio.sleep(0.05)
                continue
            idle = 0
            for ticket in tickets:
                out.append(["claim", ticket["id"], ticket["token"], now, ticket["lease_until"]])
            for ticket in tickets:
                fate = rng.random()
                if fate < 0.05:
                    continue                                # abandoned: reclaimed later
                if fate < 0.10:
                    await asyncio.sleep(lease_ms * 1.5 / 1000)   # stalled beyond the lease
                ok = await send(w.fresh_event(ticket), ticket["token"])
                at = epoch_ms()
                status = await queue.finish(ticket, "ok" if ok else "retry", at)
                out.append(["finish", ticket["id"], ticket["token"], at, status])

async def main(url, sinks, prefix, lease_ms):
    out, sinks = [], sinks.split(",")
    await asyncio.gather(*(coroutine(url, sinks[i % len(sinks)], f"{prefix}-{i}", out,
                                     random.Random(f"{prefix}-{i}"), int(lease_ms))
                           for i in range(8)))
    print(json.dumps(out))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.timeout(300)  # (four worker processes and two sinks: on a busy machine, minutes)
def test_four_processes_of_eight_sessions_claim_without_overlap(pg_db):
    url = pg_db()
    qty = {f"c{i:04d}": i % 9 + 1 for i in range(600)}
    con = pg.connect(url)
    pg.drive(
        con,
        w.plan_enqueue_many(
            [({"id": i, "qty": n}, 120_000, 16) for i, n in qty.items()],
            epoch_ms(),
            limits=w.PRODUCT,
        ),
    )
    con.close()
    with sink_process(url) as one, sink_process(url) as two:
        workers = [
            start(
                [sys.executable, "-c", WORKER, url, f"{one},{two}", f"p{n}", str(LEASE_MS)],
                stdout=PIPE,
            )
            for n in range(4)
        ]
        try:
            outputs = [p.communicate(timeout=120)[0] for p in workers]
        finally:
            stop(*workers)
        assert [p.returncode for p in workers] == [0, 0, 0, 0]
        applied = sum(sink_stats(s)["applied"] for s in (one, two))
    records = [r for output in outputs for r in json.loads(output)]
    check_leases(records)
    jobs = {row[0]: row[1:] for row in query(url, "SELECT id, status, token FROM jobs")}
    assert {status for status, _ in jobs.values()} == {"done"}
    done = [(r[1], r[2]) for r in records if r[0] == "finish" and r[4] == "done"]
    assert sorted(done) == sorted((i, jobs[i][1]) for i in qty)  # each job done once
    stale = [r for r in records if r[0] == "finish" and r[4] is False]
    assert stale, "no stale finish was tried: the stalls did not outlast a lease"
    total, inbox = sink_state(url)
    assert {i: q for i, q, _ in inbox} == qty and total == sum(qty.values())
    assert applied == len(qty)  # each effect once


def check_leases(records):
    """Per job, in token order: each claim starts after the previous lease ended or was
    finished, at a later instant, with the next token; finishes land inside their lease."""
    claims: dict[str, dict[int, list[int]]] = {}
    for _, job_id, token, at, until in (r for r in records if r[0] == "claim"):
        assert token not in claims.setdefault(job_id, {}), f"token {token} of {job_id} twice"
        claims[job_id][token] = [at, until]
    for _, job_id, token, at, status in (r for r in records if r[0] == "finish"):
        if status is not False:
            began, until = claims[job_id][token]
            assert began <= at < until, f"{job_id}/{token} finished outside its lease"
            claims[job_id][token][1] = at  # released at the finish
    for job_id, leases in claims.items():
        tokens = sorted(leases)
        assert tokens == list(range(1, len(tokens) + 1)), (job_id, tokens)
        for earlier, later in itertools.pairwise(tokens):
            assert leases[later][0] >= leases[earlier][1], (
                f"{job_id}: token {later} claimed at {leases[later][0]}, while token "
                f"{earlier} held it until {leases[earlier][1]}"
            )
