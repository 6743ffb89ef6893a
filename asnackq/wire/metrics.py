"""Prometheus metrics: the queue's state (the dashboard) and a running Dispatcher (``work``).

Rules of this module:

* Text exposition format 0.0.4.  Every family has ``HELP`` and ``TYPE`` lines; names start
  with ``asnackq_``; counters end in ``_total``; times are in seconds.
* Rendering is a pure function of a snapshot (``ops.stats`` or a Dispatcher's counts): the
  DB reads and the server live elsewhere, so one rendering serves every endpoint.
* A metrics endpoint only answers ``GET /metrics`` (and ``HEAD``): other methods get 405,
  other paths 404.  It binds loopback unless remote access is allowed explicitly.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asnackq.core.receivers import is_loopback
from asnackq.core.worker import DEAD_REASONS
from asnackq.core.worker import STATUSES as JOB_STATUSES

if TYPE_CHECKING:
    from aiohttp import web


__all__ = [
    "CONTENT_TYPE",
    "REASONS",
    "Family",
    "Histogram",
    "check_host",
    "counter",
    "endpoint_families",
    "exposition",
    "gauge",
    "labelled",
    "queue_families",
    "render",
    "screen_expect",
    "serving",
]

CONTENT_TYPE = "text/plain"
CHARSET = "utf-8"
FORMAT = "0.0.4"
REASONS = DEAD_REASONS
STATUSES = JOB_STATUSES
# Prometheus' default buckets, in seconds: sends take milliseconds to a lease's length.
SEND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
Labels = dict[str, str]


@dataclass(frozen=True)
class Family:
    """One metric family: its name, type, help text, and ``(suffix, labels, value)`` samples.

    The name is the samples' own (a counter's ends in ``_total``, as the 0.0.4 format has it);
    only a histogram's samples add a suffix (``_bucket``, ``_sum``, ``_count``).
    """

    name: str
    kind: str  # counter, gauge or histogram
    help: str
    samples: list[tuple[str, Labels, float]]


def gauge(name: str, text: str, value: float, labels: Labels | None = None) -> Family:
    return Family(name, "gauge", text, [("", labels or {}, value)])


def counter(name: str, text: str, value: float) -> Family:
    return Family(name, "counter", text, [("", {}, value)])


def labelled(name: str, kind: str, text: str, label: str, values: dict[str, int]) -> Family:
    """One sample per label value."""
    return Family(name, kind, text, [("", {label: key}, value) for key, value in values.items()])


def number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    return repr(value)


def escape(text: str, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def render(families: Iterable[Family]) -> str:
    """The families in the text exposition format (one trailing newline)."""
    lines = []
    for family in families:
        lines += [
            f"# HELP {family.name} {escape(family.help, False)}",
            f"# TYPE {family.name} {family.kind}",
        ]
        for suffix, labels, value in family.samples:
            shown = ",".join(f'{key}="{escape(v, True)}"' for key, v in labels.items())
            lines.append(
                f"{family.name}{suffix}{{{shown}}} {number(value)}"
                if shown
                else f"{family.name}{suffix} {number(value)}"
            )
    return "\n".join(lines) + "\n"


# --- the queue (read by the dashboard) ---------------------------------------------------


def queue_families(stats: dict[str, Any]) -> list[Family]:
    """The queue's gauges from an ``ops.stats`` result."""
    by_status = {status: stats["by_status"].get(status, 0) for status in STATUSES}
    reasons = {reason: stats["dead_by_reason"].get(reason, 0) for reason in REASONS}
    oldest = stats["oldest_pending_ms"]
    return [
        labelled(
            "asnackq_queue_jobs", "gauge", "Jobs in the queue by status.", "status", by_status
        ),
        labelled("asnackq_queue_dead_jobs", "gauge", "Dead jobs by reason.", "reason", reasons),
        gauge(
            "asnackq_queue_oldest_pending_age_seconds",
            "How long the oldest claimable pending job has waited (0: none waits).",
            0 if oldest is None else oldest / 1000,
        ),
        gauge(
            "asnackq_queue_expired_leases",
            "Leased jobs whose lease has expired: awaiting reclaim.",
            stats["expired_leases"],
        ),
        *endpoint_families(stats.get("endpoints", [])),
    ]


# Each endpoint's figures (``ops.per_endpoint``): field -> (name, help), a sample each.
ENDPOINT_GAUGES = {
    "enabled": ("asnackq_endpoint_enabled", "1 while the endpoint is enabled, 0 while disabled."),
    "oldest": (
        "asnackq_endpoint_oldest_pending_age_seconds",
        "How long the endpoint's oldest pending delivery has waited since its intake (0: none).",
    ),
    "workers": (
        "asnackq_endpoint_workers",
        "Workers that said within the last 15 s that they serve the endpoint.",
    ),
    "open": (
        "asnackq_endpoint_breaker_open_workers",
        "Of those workers, how many have the endpoint's circuit breaker open.",
    ),
    "limit": (
        "asnackq_endpoint_limit",
        "Sends those workers let in flight to the endpoint at once, added up (their limits now).",
    ),
}


def endpoint_families(endpoints: list[dict[str, Any]]) -> list[Family]:
    """Each endpoint's gauges, labelled ``endpoint="NAME"``: its deliveries by status
    (pending is its backlog, leased its sends in flight), its state, its oldest pending
    delivery's age, and what its workers say of its breaker and limit."""
    if not endpoints:
        return []
    values: dict[str, Callable[[dict[str, Any]], float]] = {
        "enabled": lambda e: int(e["state"] == "enabled"),
        "oldest": lambda e: (e["oldest_pending_ms"] or 0) / 1000,
        "workers": lambda e: len(e["workers"]),
        "open": lambda e: sum(one["breaker"] == "open" for one in e["workers"]),
        "limit": lambda e: e["limit"] or 0,
    }
    counts = {"pending": "backlog", "leased": "in_flight", "done": "done", "dead": "dead"}
    families = [
        Family(
            "asnackq_endpoint_deliveries",
            "gauge",
            "The endpoint's deliveries by status.",
            [
                ("", {"endpoint": e["name"], "status": status}, e[key])
                for e in endpoints
                for status, key in counts.items()
            ],
        )
    ]
    for key, (name, text) in ENDPOINT_GAUGES.items():
        samples = [("", {"endpoint": e["name"]}, values[key](e)) for e in endpoints]
        families.append(Family(name, "gauge", text, samples))
    return families


# --- a running Dispatcher (``work --metrics-port``) ------------------------------------


@dataclass
class Histogram:
    """Cumulative-bucket histogram of durations in seconds."""

    bounds: tuple[float, ...] = SEND_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, +Inf last
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def family(self, name: str, text: str) -> Family:
        samples: list[tuple[str, Labels, float]] = []
        seen = 0
        for bound, count in zip([*self.bounds, math.inf], self.counts, strict=True):
            seen += count
            samples.append(("_bucket", {"le": "+Inf" if math.isinf(bound) else repr(bound)}, seen))
        samples += [("_sum", {}, self.sum), ("_count", {}, seen)]
        return Family(name, "histogram", text, samples)


# --- serving ------------------------------------------------------------------------------


def host_name(host: str) -> str:
    """The name in a Host header, without its port (``[::1]:80`` -> ``::1``)."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def loopback_name(request: web.BaseRequest) -> bool:
    """Whether the request's Host header (if any) names a loopback address or ``localhost``:
    a server bound to loopback refuses any other name (421), so that no web page can read
    it through DNS rebinding (a name of the page's that resolves to 127.0.0.1)."""
    host = request.headers.get("Host")
    return host is None or is_loopback(host_name(host))


def check_host(host: str, allow_remote: bool) -> None:
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing to bind non-loopback host {host!r} without --allow-remote")


def exposition(text: str) -> web.Response:
    from aiohttp import web  # imported when served: the command line stays light

    return web.Response(
        body=text.encode(CHARSET),
        headers={
            "Content-Type": f"{CONTENT_TYPE}; version={FORMAT}; charset={CHARSET}",
            "Cache-Control": "no-store",
        },
    )


RequestHandler = Callable[["web.BaseRequest"], Awaitable["web.StreamResponse"]]
Refusal = Callable[["web.BaseRequest", "web.HTTPException"], "web.HTTPException"]


def screen_expect(handler: RequestHandler, shape: Refusal | None = None) -> RequestHandler:
    """Refuse (417) any ``Expect`` but ``100-continue`` before the application sees it
    (``shape`` may give the refusal its body and log it).

    aiohttp's own expect handler echoes the header into its 417: a byte that is not UTF-8
    made that a 500, on every path and method (found by the fuzz tests).
    """
    from aiohttp import web

    async def screened(request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get("Expect")
        if expect and expect.lower() != "100-continue":
            refusal = web.HTTPExpectationFailed(text="only 'Expect: 100-continue' is understood")
            raise refusal if shape is None else shape(request, refusal)
        return await handler(request)

    return screened


def screen_host(handler: RequestHandler) -> RequestHandler:
    """Refuse (421) a request whose Host names anything but loopback (``loopback_name``)."""
    from aiohttp import web

    async def screened(request: web.BaseRequest) -> web.StreamResponse:
        if not loopback_name(request):
            raise web.HTTPMisdirectedRequest(text="this server answers loopback names only\n")
        return await handler(request)

    return screened


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    host: str,
    port: int,
    log: logging.Logger | None = None,
    loopback_names: bool = False,
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` and yield its base URL (``http://HOST:PORT``);
    aiohttp's server errors (a malformed request) go to ``log``.  ``loopback_names``: a
    request whose Host names anything but loopback is refused, 421 (``loopback_name``)."""
    from aiohttp import web

    options: dict[str, Any] = {} if log is None else {"logger": log}
    runner = web.AppRunner(app, handle_signals=False, access_log=None, **options)
    await runner.setup()
    assert runner.server is not None
    handler = screen_expect(runner.server.request_handler)
    runner.server.request_handler = screen_host(handler) if loopback_names else handler
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        yield f"http://{shown}:{bound[1]}"
    finally:
        await runner.cleanup()
