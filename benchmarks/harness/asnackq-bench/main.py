#!/usr/bin/env python3
"""asnackq adapter for hardbyte/postgresql-job-queue-benchmarking (its CONTRIBUTING_ADAPTERS.md).

One long-running process: a producer and a ``Dispatcher`` on one ``AsyncQueue`` (as
docs/embedding.md's first program uses them), at the library's defaults but the worker count
(``Dispatcher(queue, send, concurrency=WORKER_COUNT)``).  Each job's work is the send: it
waits ``JOB_WORK_MS`` (1 ms) and answers True, like the other adapters' handlers.  JSONL
samples on stdout every ``SAMPLE_EVERY_S``; logs on stderr; SIGTERM ends it within 5 s.

Producer (``PRODUCER_MODE``): ``depth-target`` keeps ``TARGET_DEPTH`` jobs pending, in
calls of up to ``PRODUCER_BATCH_MAX`` (128) jobs; ``fixed`` takes the harness's
``ENQUEUE <n>`` tokens on stdin (``PRODUCER_PACING=harness``) or paces ``PRODUCER_RATE``
itself on real elapsed time.  ``PRODUCER_API``: ``many`` (default) is one
``queue.enqueue_many`` per call, the documented bulk intake; ``one`` is the same jobs as
concurrent ``queue.enqueue`` calls, one per job (an application's request handlers).

A job's id carries its enqueue time (``<instance>-<seq>-<epoch ms>``), so the claim latency
(enqueue to the start of its work) survives a restart of the process.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import os
import signal
import sys
import time
from typing import Any

import psycopg

from asnackq.aio import AsyncQueue, Dispatcher

SYSTEM = "asnackq"
PENDING = "SELECT count(*) FROM jobs WHERE status = 'pending'"
OBSERVER = frozenset({"queue_depth", "producer_target_rate"})


def env_int(key: str, default: int) -> int:
    value = os.environ.get(key)
    return int(value) if value else default


def database_url() -> str:
    url = os.environ["DATABASE_URL"]
    return "postgresql://" + url.split("://", 1)[1] if url.startswith("postgres://") else url


def emit(record: dict[str, Any]) -> None:
    record.setdefault("instance_id", env_int("BENCH_INSTANCE_ID", 0))
    print(json.dumps(record), flush=True)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Stats:
    """Counts and a bounded ring of (monotonic time, claim latency ms) for percentiles."""

    def __init__(self) -> None:
        self.enqueued = 0
        self.completed = 0
        self.depth = 0
        self.target_rate = 0.0
        self.latencies: collections.deque[tuple[float, float]] = collections.deque(maxlen=65536)

    def trace(self, kind: str, ticket: dict[str, Any], at: int, status: object) -> None:
        if kind == "finish" and status == "done":
            self.completed += 1

    def percentiles(self, window_s: float = 30.0) -> tuple[float, float, float]:
        cutoff = time.monotonic() - window_s
        values = sorted(v for t, v in self.latencies if t >= cutoff)
        if not values:
            return 0.0, 0.0, 0.0
        last = len(values) - 1
        p50, p95, p99 = (values[min(last, round(p * last))] for p in (0.5, 0.95, 0.99))
        return p50, p95, p99


class Producer:
    """Makes jobs and hands them to the queue through its public intake."""

    def __init__(self, queue: AsyncQueue, stats: Stats) -> None:
        self.queue, self.stats = queue, stats
        self.instance = env_int("BENCH_INSTANCE_ID", 0)
        self.seq = 0
        self.one = os.environ.get("PRODUCER_API", "many") == "one"
        self.run_id = f"{int(time.time()) % 100000}"

    async def put(self, n: int) -> None:
        born = int(time.time() * 1000)
        events = []
        for _ in range(n):
            self.seq += 1
            events.append({"id": f"r{self.run_id}i{self.instance}-{self.seq}-{born}", "qty": 1})
        if self.one:
            await asyncio.gather(*(self.queue.enqueue(e) for e in events))
        else:
            await self.queue.enqueue_many(events)
        self.stats.enqueued += n
        self.stats.depth += n  # until the next poll (at most 100 ms) reads it


async def depth_loop(url: str, stats: Stats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as con:
                while not stop.is_set():
                    row = await (await con.execute(PENDING)).fetchone()
                    stats.depth = int(row[0]) if row else 0
                    await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=0.1)
        except psycopg.Error as error:
            print(f"[asnackq] depth poll: {error}", file=sys.stderr)
            await asyncio.sleep(0.5)


async def depth_target(producer: Producer, stats: Stats, stop: asyncio.Event) -> None:
    target, batch_max = env_int("TARGET_DEPTH", 1000), env_int("PRODUCER_BATCH_MAX", 128)
    batch_s = env_int("PRODUCER_BATCH_MS", 10) / 1000
    while not stop.is_set():
        n = min(batch_max, target - stats.depth)
        if n <= 0:
            await asyncio.sleep(batch_s)
            continue
        await guarded(producer.put(n))


async def fixed_rate(producer: Producer, stats: Stats, stop: asyncio.Event) -> None:
    rate, batch_max = env_int("PRODUCER_RATE", 800), env_int("PRODUCER_BATCH_MAX", 128)
    stats.target_rate = float(rate)
    if os.environ.get("PRODUCER_PACING", "harness") == "harness":
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while not stop.is_set() and (line := await reader.readline()):
            if line.startswith(b"ENQUEUE "):
                await guarded(producer.put(int(line.split()[1])))
        return
    credit, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(env_int("PRODUCER_BATCH_MS", 10) / 1000)
        now = time.monotonic()
        credit, last = credit + rate * (now - last), now  # real elapsed time
        n = min(batch_max, int(credit))
        if n:
            credit -= n
            await guarded(producer.put(n))


async def guarded(put: Any) -> None:
    try:
        await put
    except Exception as error:  # a restarting server: log, back off, go on
        print(f"[asnackq] producer: {type(error).__name__}: {error}", file=sys.stderr)
        await asyncio.sleep(0.2)


async def sampler(stats: Stats, stop: asyncio.Event) -> None:
    every = env_int("SAMPLE_EVERY_S", 5)
    await asyncio.sleep(every - time.time() % every)  # clock-aligned ticks
    last_enq, last_cmp, last_t = stats.enqueued, stats.completed, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(every - time.time() % every)
        now = time.monotonic()
        span = max(now - last_t, 1e-3)
        p50, p95, p99 = stats.percentiles()
        metrics = [
            ("claim_p50_ms", p50, 30.0),
            ("claim_p95_ms", p95, 30.0),
            ("claim_p99_ms", p99, 30.0),
            ("enqueue_rate", (stats.enqueued - last_enq) / span, float(every)),
            ("completion_rate", (stats.completed - last_cmp) / span, float(every)),
            ("queue_depth", float(stats.depth), 0.0),
            ("producer_target_rate", stats.target_rate, 0.0),
        ]
        last_enq, last_cmp, last_t = stats.enqueued, stats.completed, now
        ts = now_iso()
        for metric, value, window in metrics:
            if metric in OBSERVER and env_int("BENCH_INSTANCE_ID", 0) != 0:
                continue
            emit(
                {
                    "t": ts,
                    "system": SYSTEM,
                    "kind": "adapter",
                    "subject_kind": "adapter",
                    "subject": "",
                    "metric": metric,
                    "value": value,
                    "window_s": window,
                }
            )


async def long_horizon() -> None:
    url, stats, stop = database_url(), Stats(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    work_s = env_int("JOB_WORK_MS", 1) / 1000

    async def send(event: dict[str, Any], token: int) -> bool:
        born = int(event["id"].rsplit("-", 1)[1])
        stats.latencies.append((time.monotonic(), max(0.0, time.time() * 1000 - born)))
        await asyncio.sleep(work_s)  # the job's work
        return True

    async with AsyncQueue.open(url) as queue:
        emit(
            {
                "kind": "descriptor",
                "system": SYSTEM,
                "event_tables": ["public.jobs"],
                "extensions": [],
                "version": version(),
                "schema_version": "current",
                "db_name": url.rsplit("/", 1)[1].split("?")[0],
                "started_at": now_iso(),
            }
        )
        dispatcher = Dispatcher(
            queue, send, concurrency=env_int("WORKER_COUNT", 32), trace=stats.trace
        )
        producer = Producer(queue, stats)
        loop = depth_target if os.environ.get("PRODUCER_MODE") == "depth-target" else fixed_rate
        tasks = [
            asyncio.ensure_future(t)
            for t in (
                dispatcher.run(follow=True),
                loop(producer, stats, stop),
                depth_loop(url, stats, stop),
                sampler(stats, stop),
            )
        ]
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopping, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        dispatcher.stop()
        await asyncio.wait(tasks, timeout=4)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, stopping, return_exceptions=True)
        if isinstance(results[0], BaseException) and not isinstance(
            results[0], asyncio.CancelledError
        ):
            print(f"[asnackq] dispatcher ended: {results[0]!r}", file=sys.stderr)
    print("[asnackq] long_horizon: stopped", file=sys.stderr)


def version() -> str:
    from asnackq.core import VERSION

    return str(VERSION)


if __name__ == "__main__":
    asyncio.run(long_horizon())
