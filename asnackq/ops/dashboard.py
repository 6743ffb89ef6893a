"""``asnackq dashboard``: a live, read-only web view of a queue and, optionally, its sink.

Rules of this module:

* Read-only: every figure comes from the watcher (``ops.watcher``), which opens the DBs
  read-only; the dashboard never writes, creates or migrates anything.
* Every log line is one line (``asnackq.wire.logs``): a malformed request never writes a
  traceback.
* Only ``GET`` (and ``HEAD``) on ``/`` (the page), ``/api/state`` (the JSON the page shows,
  for scripts too), ``/metrics`` (Prometheus), and ``/jobs/{id}`` (the page, inspecting a
  job) with ``/api/jobs/{id}`` (that job as JSON): other methods get 405, other paths 404.
  A job id that is not one is a 400, an unknown job a 404, an unreadable DB a 503, each
  with a one-line message; job lookups run one at a time.
* Loopback only unless ``--allow-remote``; on loopback, a request whose Host header names
  anything else is refused (421), so no web page can read it through DNS rebinding.  With
  ``--auth-token T`` every route wants ``Authorization: Bearer T`` or HTTP Basic with
  password T (a browser asks for it).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import importlib.resources
import logging
import re
import signal
from typing import Any

from aiohttp import web

from asnackq.ops import inspect
from asnackq.ops.watcher import Watcher
from asnackq.store.targets import Target
from asnackq.wire import logs, metrics

__all__ = ["dashboard_app", "serve"]

TOKEN = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII: it travels in a header
LOG = logging.getLogger("asnackq.ops.dashboard")


# --- the web app ---------------------------------------------------------------------------

WATCHER = web.AppKey("watcher", Watcher)
LOOKUPS = web.AppKey("lookups", asyncio.Lock)  # one job lookup at a time
SAID = '<p id="said" role="status"></p>'  # where /jobs/{id} says why it has no job
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


def guard(token: str | None, loopback_only: bool) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if loopback_only and not metrics.loopback_name(request):
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


async def look_up(request: web.Request) -> tuple[int, dict[str, Any]]:
    """The answer about ``/jobs/{id}``: its status and its JSON (the job, or ``error``)."""
    job_id = request.match_info["id"]
    try:
        inspect.check_job_id(job_id)
    except ValueError as error:
        return 400, {"error": str(error)}
    watcher = request.app[WATCHER]
    async with request.app[LOOKUPS]:
        try:
            story = await watcher.look_up(job_id)
        except ValueError as error:
            return 503, {"error": str(error)}
    if story is None:
        where = "the queue or the sink DB" if watcher.sink_db is not None else "the queue"
        return 404, {"error": f"no job {job_id!r} in {where}"}
    return 200, story


async def get_job(request: web.Request) -> web.Response:
    status, answer = await look_up(request)
    return web.json_response(answer, status=status)


async def get_job_page(request: web.Request) -> web.Response:
    """The page, inspecting the job (its script reads ``/api/jobs/{id}``); a 400, 404 or
    503 also says why in the page itself, escaped."""
    status, answer = await look_up(request)
    text = PAGE
    if status != 200:
        said = html.escape(answer["error"])
        text = PAGE.replace(SAID, f'<p id="said" role="status" class="bad">{said}</p>')
    return web.Response(text=text, status=status, content_type="text/html")


def dashboard_app(
    watcher: Watcher, token: str | None = None, loopback_only: bool = True
) -> web.Application:
    """The dashboard over a watcher that has read once; it samples while the app runs."""
    app = web.Application(middlewares=[guard(token, loopback_only)])
    app[WATCHER] = watcher
    app[LOOKUPS] = asyncio.Lock()
    app.router.add_get("/", get_page)
    app.router.add_get("/api/state", get_state)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/jobs/{id}", get_job_page)
    app.router.add_get("/api/jobs/{id}", get_job)

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
    logs.to_stderr(LOG, "asnackq dashboard")

    async def main() -> None:
        await watcher.sample()  # a missing or unreadable DB: one line, exit 1
        app = dashboard_app(watcher, auth_token, loopback_only=not allow_remote)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with metrics.serving(app, host, port, LOG) as url:
            print(f"asnackq dashboard listening on {url}/", flush=True)
            await stop.wait()

    asyncio.run(main())
    return 0
