"""What Standard Webhooks signatures cost: per delivery, and end to end.

    python benchmarks/signing.py [--jobs 3000] [--concurrency 64] [--rounds 5]

Per delivery (this process, no I/O): signing one request's headers with one and with two
active secrets (a rotation), and verifying them with ``asnackq.wire.webhooks.verify`` and
with the official ``standardwebhooks`` library, for a 200-byte and a 16 KiB body; in
microseconds, the best of 5 repetitions.

End to end: a Dispatcher with ``success="2xx"`` delivers ``--jobs`` jobs from a SQLite queue to
an aiohttp receiver in a child process that answers 204, once unsigned and once signed (the
receiver then verifies every request with the official library and refuses a bad one with
401: nothing goes unchecked; ``--no-verify``: it verifies nothing, which leaves the sender's
cost alone); the two alternate within each round, the signed run first in
odd rounds. Printed: each round's jobs/s and the median of the per-round ratios
signed/unsigned, with their range. Target: >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import timeit
from pathlib import Path
from statistics import median

from aiohttp import web
from dispatch_e2e import fill
from sink_throughput import start

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.wire import webhooks as wh
from asnackq.wire.send import AsyncHttpSender

SECRET = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWY="  # 32 fixed bytes


def per_delivery() -> None:
    print(f"{'body':>8} {'sign 1 key':>11} {'sign 2 keys':>12} {'verify':>8} {'official':>9}  (us)")
    for size in (200, 16 * 1024):
        us = costs(b'{"k": "' + b"x" * (size - 10) + b'"}')
        print(
            f"{size:>8} {us['sign1']:>11.1f} {us['sign2']:>12.1f} {us['verify']:>8.1f} "
            f"{us['official']:>9.1f}"
        )


def costs(body: bytes) -> dict[str, float]:
    """Microseconds per call of each step, for one body."""
    from standardwebhooks.webhooks import Webhook

    one, two = (
        [wh.parse_secret(SECRET)],
        [wh.parse_secret(wh.new_secret()), *wh.Keyring.of(SECRET).keys()],
    )
    official = Webhook(SECRET)
    headers = wh.signed_headers(one, "job-123", body)
    steps = {
        "sign1": lambda: wh.signed_headers(one, "job-123", body),
        "sign2": lambda: wh.signed_headers(two, "job-123", body),
        "verify": lambda: wh.verify(one, headers, body),
        "official": lambda: official.verify(body, headers, json_parse=False),
    }
    return {k: min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6 for k, f in steps.items()}


def serve(verifying: bool = True) -> None:
    """A receiver answering 204: a signed request is verified (401 if it fails), unless
    ``verifying`` is off (the sender's cost alone)."""
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    verifier = Webhook(SECRET)

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        if verifying and "webhook-signature" in request.headers:
            try:
                verifier.verify(body, dict(request.headers), json_parse=False)
            except WebhookVerificationError:
                return web.Response(status=401)
        return web.Response(status=204)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/hook", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(f"serving http://127.0.0.1:{port}/hook", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def deliver(path: Path, url: str, jobs: int, concurrency: int, signed: bool) -> float:
    fill(path, jobs, "signed" if signed else "plain")
    secrets = [SECRET] if signed else None
    sender = AsyncHttpSender(url, success="2xx", secrets=secrets)
    async with AsyncQueue.open(path) as queue, sender as send:
        started = time.perf_counter()
        summary = await Dispatcher(
            queue, send, owner="bench", concurrency=concurrency, lease_ms=5000
        ).run(until_empty=True)
        elapsed = time.perf_counter() - started
    assert summary.done == jobs, summary
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--no-verify", action="store_true", help="the receiver verifies nothing: the sender's cost"
    )
    parser.add_argument("--serve", choices=("verifying", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve == "verifying")
        return
    per_delivery()
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
        kind = "plain" if args.no_verify else "verifying"
        receiver, url = start([sys.executable, __file__, "--serve", kind])
        try:
            for r in range(args.rounds):
                got: dict[bool, float] = {}
                for signed in (True, False) if r % 2 else (False, True):
                    db = Path(tmp) / f"r{r}{signed}.db"
                    got[signed] = asyncio.run(deliver(db, url, args.jobs, args.concurrency, signed))
                ratios.append(got[True] / got[False])
                print(
                    f"round {r}: unsigned {got[False]:7.0f} jobs/s, signed {got[True]:7.0f} jobs/s"
                )
        finally:
            receiver.terminate()
            receiver.wait(timeout=30)
    ratios.sort()
    print(
        f"signed / unsigned at concurrency {args.concurrency}: {median(ratios):.2f} "
        f"({ratios[0]:.2f}-{ratios[-1]:.2f}) over {args.rounds} rounds; target >= 0.9"
    )


if __name__ == "__main__":
    main()
