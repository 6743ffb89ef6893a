"""``asnackq dashboard``: a live, read-only web view of a queue and, optionally, its sink.

Rules of this module:

* Read-only.  Each sample opens the DBs through ``readers.read_only`` (``mode=ro`` URIs for a
  file, read-only transactions for a ``postgresql://`` URL) and closes them; the dashboard
  never writes, creates or migrates anything.  The numbers are ``ops.stats`` and
  ``ops.audit``, the same as ``asnackq stats`` and ``asnackq audit``.  A URL is shown with
  its password as ``***``.
* One watcher task reads the DBs every ``SAMPLE_S`` (in a thread), or ten times the last
  sample's reading time when that is longer, never more than ``MAX_GAP_S`` apart; it
  keeps the last minute of done counts for the throughput.  Requests are answered from the
  latest sample, so open pages add no load on the queue.  The audit (a join over every
  job) runs at most every ten times its duration, at least every ``MAX_AUDIT_GAP_S``.
* A file locked by a writer is not waited on inside SQLite: the read is retried for
  ``LOCK_WAIT_S``, then the page says so (the last figures stay, marked) and the next
  try comes after ``SAMPLE_S``.  A wait for a lock never counts as reading time.
* Every log line is one line (``asnackq.wire.logs``): a malformed request never writes a
  traceback.
* Only ``GET`` (and ``HEAD``) on ``/`` (the page), ``/api/state`` (the JSON the page shows,
  for scripts too) and ``/metrics`` (Prometheus): other methods get 405, other paths 404.
* Loopback only unless ``--allow-remote``; on loopback, a request whose Host header names
  anything else is refused (421), so no web page can read it through DNS rebinding.  With
  ``--auth-token T`` every route wants ``Authorization: Bearer T`` or HTTP Basic with
  password T (a browser asks for it).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import hmac
import importlib.resources
import itertools
import logging
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aiohttp import web

from asnackq import ops
from asnackq.core import worker as w
from asnackq.store import readers, sessions
from asnackq.store.sessions import Reader
from asnackq.store.targets import Target, one_line, shown
from asnackq.wire import logs, metrics
from asnackq.wire.send import is_loopback

__all__ = ["Watcher", "dashboard_app", "serve"]

SAMPLE_S = 1.0
MAX_GAP_S = 5.0  # the longest pause between samples, however long a read takes
MAX_AUDIT_GAP_S = 60.0  # the longest pause between audits
LOCK_WAIT_S = 1.0  # a writer's lock held longer than this shows as an error
LOCK_POLL_S = 0.02
WINDOW_MS = 60_000  # throughput over the last minute
REDRIVES_SHOWN = 10
AUDIT_LISTED = 20
SQL_LATEST_REDRIVES = "SELECT id, token, at_ms, note FROM redrives ORDER BY seq DESC LIMIT ?"
SQL_INBOX = """SELECT (SELECT count(*) FROM inbox), (SELECT coalesce(sum(deliveries), 0)
FROM inbox), (SELECT coalesce(max(total), 0) FROM stock)"""
TOKEN = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII: it travels in a header
LOG = logging.getLogger("asnackq.ops.dashboard")


Reading = Callable[[], Any]


def attempt(what: str, where: Target, read: Reading) -> tuple[Any, float]:
    """``read()`` and the seconds it took, retried while a writer holds the file.

    A lock is waited out by retrying (for ``LOCK_WAIT_S`` at most; then ``readers.Locked``), not
    inside SQLite's busy handler: the time returned is that of the read that succeeded, so a
    wait for a writer is never taken for the cost of reading.  Anything unreadable is a
    ``ValueError`` (one line; a URL's password never shown).
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        started = time.monotonic()
        try:
            return read(), time.monotonic() - started
        except Exception as error:
            if readers.locked(error):
                if time.monotonic() < deadline:
                    time.sleep(LOCK_POLL_S)
                    continue
                raise readers.Locked(
                    f"the {what} {shown(where)} is locked by another process (held over "
                    f"{LOCK_WAIT_S:g} s): the figures shown are older"
                ) from None
            if isinstance(error, ValueError):
                raise
            if not sessions.database_error(error):
                raise
            raise ValueError(f"cannot read the {what} {shown(where)}: {one_line(error)}") from None


def read_queue(con: Reader, now_ms: int) -> dict[str, Any]:
    redrives = [
        dict(zip(("id", "token", "at_ms", "note"), row, strict=True))
        for row in con.execute(SQL_LATEST_REDRIVES, (REDRIVES_SHOWN,))
    ]
    return {"stats": ops.stats(con, now_ms), "redrives": redrives}


def read_inbox(con: Reader) -> dict[str, int]:
    rows, deliveries, stock = con.execute(SQL_INBOX).fetchone()
    return {
        "effects_applied": rows,
        "deliveries": deliveries,
        "duplicates": deliveries - rows,
        "stock": stock,
    }


def audit_state(audited: ops.Audit, now_ms: int) -> dict[str, Any]:
    return {
        "at_ms": now_ms,
        "flags": audited.flags,
        "violations": audited.violations,
        "stages": audited.stages,
        "attention": audited.listed["attention"],
        "violating": audited.listed["violations"],
    }


def reading(where: Target, table: str, what: str, reader: Callable[[Reader], Any]) -> Reading:
    """One read-only session on ``where`` (a file, without waiting on a lock, or a URL)."""

    def read() -> Any:
        with readers.read_only(where, table, what, busy_s=0) as con:
            return reader(con)

    return read


@dataclass
class Watcher:
    """The latest reading of the DBs, and the done counts of the last minute."""

    queue: Target
    sink_db: Target | None = None
    state: dict[str, Any] = field(default_factory=dict)
    done: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    audit_due: float = 0.0
    took: float = 0.0  # seconds the last sample spent reading (lock waits excluded)

    def sample(self) -> None:
        """Read everything once; ``ValueError`` (``readers.Locked`` for a lock) if a DB cannot be
        read, and then the last state stays."""
        now = w.epoch_ms()
        queue, took = attempt(
            "queue",
            self.queue,
            reading(self.queue, "jobs", "queue", partial(read_queue, now_ms=now)),
        )
        state = {
            "queue": shown(self.queue),
            "sink_db": self.sink_db and shown(self.sink_db),
            "at_ms": now,
            "error": None,
            **queue,
            "inbox": None,
            "audit": self.state.get("audit"),
        }
        if self.sink_db is not None:
            read = reading(self.sink_db, "inbox", "sink DB", read_inbox)
            state["inbox"], inbox_s = attempt("sink DB", self.sink_db, read)
            took += inbox_s
            if time.monotonic() >= self.audit_due:
                audited, audit_s = attempt("queue and sink DB", self.queue, self.audit(now))
                state["audit"] = audit_state(audited, now)
                self.audit_due = time.monotonic() + min(10 * audit_s, MAX_AUDIT_GAP_S)
        state["throughput"] = self.throughput(now, state["stats"]["by_status"]["done"])
        self.state, self.took = state, took

    def audit(self, now_ms: int) -> Reading:
        assert self.sink_db is not None
        sink_db = self.sink_db
        return lambda: ops.audit(self.queue, sink_db, now_ms, limit=AUDIT_LISTED, busy_s=0)

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

    def pause(self) -> float:
        """Seconds until the next sample: ``SAMPLE_S``, or ten times the last sample's reading
        time when that is longer (a reader delays the writers' commits on a rollback journal:
        the dashboard reads at most a tenth of the time), never over ``MAX_GAP_S``."""
        return min(max(SAMPLE_S, 10 * self.took), MAX_GAP_S)

    async def run(self) -> None:
        """Sample until cancelled; a failed read shows as ``error`` over the last state, and
        the next try comes after ``SAMPLE_S`` (a lock or an error is no cost to scale by)."""
        while True:
            await asyncio.sleep(self.pause())
            try:
                await asyncio.to_thread(self.sample)
            except ValueError as error:
                self.state = {**self.state, "error": str(error), "at_ms": w.epoch_ms()}
                self.took = 0.0


# --- the web app ---------------------------------------------------------------------------

WATCHER = web.AppKey("watcher", Watcher)
PAGE = importlib.resources.files("asnackq.ops").joinpath("dashboard.html").read_text("utf-8")


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
    """``Bearer TOKEN``, or HTTP Basic with TOKEN as the password (any user name).

    A token is visible ASCII (``TOKEN``): a header with any other byte never matches.
    """
    if not header.isascii():
        return False
    if hmac.compare_digest(header, f"Bearer {token}"):
        return True
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        password = base64.b64decode(encoded, validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return False
    return password.isascii() and hmac.compare_digest(password, token)


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
    return web.json_response(request.app[WATCHER].state)


async def get_metrics(request: web.Request) -> web.Response:
    state = request.app[WATCHER].state
    if state["error"] is not None:
        return web.Response(status=503, text=f"{state['error']}\n")
    return metrics.exposition(metrics.render(metrics.queue_families(state["stats"])))


def dashboard_app(
    watcher: Watcher, token: str | None = None, loopback_only: bool = True
) -> web.Application:
    """The dashboard over a watcher that has read once; it samples while the app runs."""
    app = web.Application(middlewares=[guard(token, loopback_only)])
    app[WATCHER] = watcher
    app.router.add_get("/", get_page)
    app.router.add_get("/api/state", get_state)
    app.router.add_get("/metrics", get_metrics)

    async def sampling(app: web.Application) -> Any:
        task = asyncio.create_task(watcher.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(sampling)
    return app


# --- the command ---------------------------------------------------------------------------


def serve(
    queue: Target,
    sink_db: Target | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    allow_remote: bool = False,
    auth_token: str | None = None,
) -> int:
    """Serve the dashboard until SIGINT or SIGTERM (``asnackq dashboard``)."""
    metrics.check_host(host, allow_remote)
    if auth_token is not None and not TOKEN.fullmatch(auth_token):
        raise ValueError("--auth-token must be 1-256 visible ASCII characters")
    watcher = Watcher(queue, sink_db)
    watcher.sample()  # a missing or unreadable DB: one line, exit 1
    app = dashboard_app(watcher, auth_token, loopback_only=not allow_remote)
    logs.to_stderr(LOG, "asnackq dashboard")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with metrics.serving(app, host, port, LOG) as url:
            print(f"asnackq dashboard listening on {url}/", flush=True)
            await stop.wait()

    asyncio.run(main())
    return 0
