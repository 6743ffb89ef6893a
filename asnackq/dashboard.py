"""``asnackq dashboard``: a live, read-only web view of a queue and, optionally, its sink.

Rules of this module:

* Read-only.  Each sample opens the DBs through ``ops.read_only`` (``mode=ro`` URIs) and
  closes them; the dashboard never writes, creates or migrates a file.  The numbers are
  ``ops.stats`` and ``ops.audit``, the same as ``asnackq stats`` and ``asnackq audit``.
* One sampler task reads the DBs every ``SAMPLE_S`` (in a thread; less often when a read
  takes longer than a tenth of that) and keeps the last minute of done counts for the
  throughput.  Requests are answered from the latest sample, so open pages add no load on
  the queue.  The audit (a join over every job) runs at most every ten times its duration.
* Only ``GET`` (and ``HEAD``) on ``/`` (the page), ``/api/state`` (the JSON the page shows,
  for scripts too) and ``/metrics`` (Prometheus): other methods get 405, other paths 404.
* Loopback only unless ``--allow-remote``; on loopback, a request whose Host header names
  anything else is refused (421), so no web page can read it through DNS rebinding.  With
  ``--auth-token T`` every route wants ``Authorization: Bearer T`` or HTTP Basic with
  password T (a browser asks for it).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import hmac
import importlib.resources
import itertools
import re
import signal
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from asnackq import metrics, ops
from asnackq.core import worker as w
from asnackq.http_send import is_loopback

__all__ = ["Sampler", "make_app", "run_dashboard"]

SAMPLE_S = 1.0
WINDOW_MS = 60_000  # throughput over the last minute
REDRIVES_SHOWN = 10
AUDIT_LISTED = 20
SQL_LATEST_REDRIVES = "SELECT id, token, at_ms, note FROM redrives ORDER BY seq DESC LIMIT ?"
SQL_INBOX = """SELECT (SELECT count(*) FROM inbox), (SELECT coalesce(sum(deliveries), 0)
FROM inbox), (SELECT coalesce(max(total), 0) FROM stock)"""
TOKEN = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII: it travels in a header


def read(what: str, path: Path, table: str, reader: Any) -> Any:
    """``reader(con)`` on a read-only connection; ``ValueError`` for anything unreadable."""
    try:
        with ops.read_only(path, table, what) as con:
            return reader(con)
    except sqlite3.Error as error:
        raise ValueError(f"cannot read the {what} {path}: {error}") from None


def read_queue(queue: Path, now_ms: int) -> dict[str, Any]:
    def reader(con: sqlite3.Connection) -> dict[str, Any]:
        redrives = [
            dict(zip(("id", "token", "at_ms", "note"), row, strict=True))
            for row in con.execute(SQL_LATEST_REDRIVES, (REDRIVES_SHOWN,))
        ]
        return {"stats": ops.stats(con, now_ms), "redrives": redrives}

    result: dict[str, Any] = read("queue", queue, "jobs", reader)
    return result


def read_inbox(sink_db: Path) -> dict[str, int]:
    rows, deliveries, stock = read(
        "sink DB", sink_db, "inbox", lambda con: con.execute(SQL_INBOX).fetchone()
    )
    return {
        "effects_applied": rows,
        "deliveries": deliveries,
        "duplicates": deliveries - rows,
        "stock": stock,
    }


def read_audit(queue: Path, sink_db: Path, now_ms: int) -> dict[str, Any]:
    try:
        audited = ops.audit(queue, sink_db, now_ms, limit=AUDIT_LISTED)
    except sqlite3.Error as error:
        raise ValueError(f"cannot audit {queue} against {sink_db}: {error}") from None
    return {
        "at_ms": now_ms,
        "flags": audited["flags"],
        "violations": audited["violations"],
        "stages": audited["stages"],
        "attention": audited["listed"]["attention"],
        "violating": audited["listed"]["violations"],
    }


@dataclass
class Sampler:
    """The latest reading of the DBs, and the done counts of the last minute."""

    queue: Path
    sink_db: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)
    done: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    audit_due: float = 0.0

    def sample(self) -> None:
        """Read everything once; ``ValueError`` if a DB cannot be read."""
        now = w.epoch_ms()
        state = {
            "queue": str(self.queue),
            "sink_db": self.sink_db and str(self.sink_db),
            "at_ms": now,
            "error": None,
            **read_queue(self.queue, now),
            "inbox": None,
            "audit": self.state.get("audit"),
        }
        if self.sink_db is not None:
            state["inbox"] = read_inbox(self.sink_db)
            if time.monotonic() >= self.audit_due:
                started = time.monotonic()
                state["audit"] = read_audit(self.queue, self.sink_db, now)
                self.audit_due = time.monotonic() + 10 * (time.monotonic() - started)
        state["throughput"] = self.throughput(now, state["stats"]["by_status"]["done"])
        self.state = state

    def throughput(self, now_ms: int, done: int) -> dict[str, Any]:
        """Done jobs per second over the last minute (``None`` until two samples)."""
        self.done.append((now_ms, done))
        while len(self.done) > 2 and self.done[1][0] <= now_ms - WINDOW_MS:
            self.done.popleft()
        first_ms, first = self.done[0]
        span_s = (now_ms - first_ms) / 1000
        # [seconds ago (negative), done/s] between consecutive samples: the sparkline.
        rates = [
            [round((b_ms - now_ms) / 1000, 1), round(max(0, b - a) * 1000 / (b_ms - a_ms), 1)]
            for (a_ms, a), (b_ms, b) in itertools.pairwise(self.done)
            if b_ms > a_ms
        ]
        return {
            "window_s": round(span_s, 1),
            "series": rates,
            "done_per_s": round(max(0, done - first) / span_s, 1) if span_s > 0 else None,
        }

    async def run(self) -> None:
        """Sample until cancelled; a failed read shows as ``error``.

        A reader delays the writers' commits on a rollback journal, so the next sample waits
        ``SAMPLE_S`` or ten times the last one's duration, whichever is longer: the dashboard
        reads at most a tenth of the time, however large the queue.
        """
        took = 0.0
        while True:
            await asyncio.sleep(max(SAMPLE_S, 10 * took))
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.sample)
            except ValueError as error:
                self.state = {**self.state, "error": str(error), "at_ms": w.epoch_ms()}
            took = time.monotonic() - started


# --- the web app ---------------------------------------------------------------------------

SAMPLER = web.AppKey("sampler", Sampler)
PAGE = importlib.resources.files("asnackq").joinpath("dashboard.html").read_text("utf-8")


def csp_hash(tag: str) -> str:
    """The CSP source for the page's one inline ``tag`` element (script or style)."""
    found = re.search(rf"<{tag}>(.*?)</{tag}>", PAGE, re.DOTALL)
    assert found is not None, tag
    digest = hashlib.sha256(found.group(1).encode()).digest()
    return f"'sha256-{base64.b64encode(digest).decode()}'"


HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {csp_hash('script')}; "
    f"style-src {csp_hash('style')}; connect-src 'self'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


def authorized(header: str, token: str) -> bool:
    """``Bearer TOKEN``, or HTTP Basic with TOKEN as the password (any user name)."""
    if hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
        return True
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        password = base64.b64decode(encoded, validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(password.encode(), token.encode())


def host_name(host: str) -> str:
    """The name in a Host header, without its port (``[::1]:80`` -> ``::1``)."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def guard(token: str | None, loopback_only: bool) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        host = request.headers.get("Host")
        if loopback_only and host is not None and not is_loopback(host_name(host)):
            return web.Response(status=421, text="this dashboard answers loopback names only\n")
        if token is not None and not authorized(request.headers.get("Authorization", ""), token):
            return web.Response(
                status=401,
                text="unauthorized\n",
                headers={"WWW-Authenticate": 'Basic realm="asnackq dashboard", charset="UTF-8"'},
            )
        response: web.StreamResponse = await handler(request)
        response.headers.update(HEADERS)
        return response

    return middleware


async def get_page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html")


async def get_state(request: web.Request) -> web.Response:
    return web.json_response(request.app[SAMPLER].state)


async def get_metrics(request: web.Request) -> web.Response:
    state = request.app[SAMPLER].state
    if state["error"] is not None:
        return web.Response(status=503, text=f"{state['error']}\n")
    return metrics.exposition(metrics.render(metrics.queue_families(state["stats"])))


def make_app(
    sampler: Sampler, token: str | None = None, loopback_only: bool = True
) -> web.Application:
    """The dashboard over a sampler that has read once; it samples while the app runs."""
    app = web.Application(middlewares=[guard(token, loopback_only)])
    app[SAMPLER] = sampler
    app.router.add_get("/", get_page)
    app.router.add_get("/api/state", get_state)
    app.router.add_get("/metrics", get_metrics)

    async def sampling(app: web.Application) -> Any:
        task = asyncio.create_task(sampler.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(sampling)
    return app


# --- the command ---------------------------------------------------------------------------


def run_dashboard(args: argparse.Namespace) -> int:
    metrics.check_host(args.host, args.allow_remote)
    if args.auth_token is not None and not TOKEN.fullmatch(args.auth_token):
        raise ValueError("--auth-token must be 1-256 visible ASCII characters")
    sampler = Sampler(args.queue, args.sink_db)
    sampler.sample()  # a missing or unreadable DB: one line, exit 1
    app = make_app(sampler, args.auth_token, loopback_only=not args.allow_remote)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with metrics.serving(app, args.host, args.port) as url:
            print(f"asnackq dashboard listening on {url}/", flush=True)
            await stop.wait()

    asyncio.run(main())
    return 0
