"""A queue's named endpoints: the value, its tables, and every change as a plan.

Rules of this module (the style of ``worker.py``; standard library only):

* An ``Endpoint`` is checked whole when it is made (a frozen dataclass), and each field
  of an update before its plan exists: a refusal is one ``ValueError`` line, raised before
  any statement, and it never repeats a secret or a header's value.
* The product's own tables, on SQLite and PostgreSQL (``asnackq.store.pg_sql``) alike, never
  part of the contract's schema: ``asnackq_endpoints``, one row per endpoint, and
  ``asnackq_endpoint_changes``, one row per change (``ACTIONS``), written in the change's
  own transaction.  A change's note says what changed; a secret appears in it only as its
  fingerprint, a header only by its name.  The tables are made by the first change.
* A change reads its row first (locked on PostgreSQL) and decides on it: adding a name
  that exists, or changing one that does not, is refused and writes nothing; a change
  that changes nothing (an update to the same values, disabling a disabled endpoint)
  writes nothing either, audit row included.
* Secrets are a keyring (``core.receivers``): ``(secret, until_ms)`` pairs, newest first;
  a rotation keeps the replaced secrets signing until ``now + overlap``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

from asnackq.core import rate as r
from asnackq.core import worker as w
from asnackq.core.receivers import SUCCESS_RULES, check_url, fingerprint, is_loopback, rotated

__all__ = [
    "ACTIONS",
    "DEFAULT_DELAYS_MS",
    "SCHEMA",
    "SQL_AUDIT",
    "SQL_CHANGES",
    "SQL_DELETE",
    "SQL_INSERT",
    "SQL_LOCK",
    "SQL_PRESENT",
    "SQL_READ",
    "SQL_WRITE",
    "Change",
    "Delays",
    "Endpoint",
    "EndpointExists",
    "Exponential",
    "NoSuchEndpoint",
    "Schedule",
    "check_change",
    "duration",
    "hidden",
    "parse_duration",
    "plan_add",
    "plan_changes",
    "plan_disable",
    "plan_enable",
    "plan_get",
    "plan_list",
    "plan_remove",
    "plan_rotate",
    "plan_update",
    "schedule_of",
]

DAY_MS = w.DAY_MS
MAX_DELAY_MS = 7 * DAY_MS  # a retry's longest wait
MAX_DELAYS = 32
MAX_TYPES = 64
MAX_SECRETS = 8
MAX_HEADERS = 16
MAX_NETWORKS = 16
MAX_URL = 2048
MAX_REASON = 200
MAX_OVERLAP_S = 30 * 86_400
DEFAULT_DELAYS_MS = (0, 5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 36_000_000)
ACTIONS = ("add", "update", "rotate", "disable", "enable", "remove")

TYPE_RULE = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*(?:\.\*)?")
URL_CHARS = re.compile(r"[!-~]+")
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")  # an RFC 9110 token
HEADER_VALUE = re.compile(r"(?:[!-~](?:[ -~]{0,1022}[!-~])?)?")  # visible ASCII, inner spaces
# Set by the sender (the event, its token, the Standard Webhooks headers, the trace) or
# framing the request: never an endpoint's to choose.
RESERVED = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "x-asnackq-token",
        "traceparent",
        "tracestate",
    }
)
# A header whose value is a credential: shown by its length only.
SENSITIVE = re.compile(r"(?i).*(auth|cookie|token|secret|key|pass|signature|session).*")


class EndpointExists(ValueError):
    """Raised when an endpoint is added under a name the queue already has."""


class NoSuchEndpoint(ValueError):
    """Raised when a change or a read names an endpoint the queue does not have."""


# --- the value ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Exponential:
    """Retries after ``base_ms``, doubling each time, never longer than ``cap_ms``."""

    base_ms: int
    cap_ms: int

    def __post_init__(self) -> None:
        w.check_int(self.base_ms, "retry base_ms", 1, MAX_DELAY_MS)
        w.check_int(self.cap_ms, "retry cap_ms", self.base_ms, MAX_DELAY_MS)


@dataclass(frozen=True)
class Delays:
    """Retries after these waits, in order (the last one repeats): 1-32 of 0..7 days."""

    ms: tuple[int, ...] = DEFAULT_DELAYS_MS

    def __post_init__(self) -> None:
        if type(self.ms) is not tuple or not 1 <= len(self.ms) <= MAX_DELAYS:
            raise ValueError(f"retry delays must be a tuple of 1-{MAX_DELAYS} waits in ms")
        for wait in self.ms:
            w.check_int(wait, "a retry delay (ms)", 0, MAX_DELAY_MS)


class Schedule(NamedTuple):
    """The waits before a delivery's retries, in order (``Delays``): retry number ``n``
    waits ``delays_ms[n - 1]``, the last one repeating, exactly as listed (no jitter: the
    breaker, not the schedule, spreads the sends after an outage)."""

    delays_ms: tuple[int, ...]

    @property
    def cap_ms(self) -> int:
        return max(self.delays_ms)

    def check(self, limits: w.Limits) -> Schedule:
        """This schedule, if every wait is within ``limits``' longest delay."""
        for wait in self.delays_ms:
            w.check_int(wait, "a retry delay (ms)", 0, limits.delay_ms)
        return self

    def delay(self, attempt: int, jitter: float, limits: w.Limits) -> int:
        """The wait before retry number ``attempt`` (``jitter`` is checked, not used)."""
        w.check_int(attempt, "attempt", 1, 16)
        w.check_jitter(jitter)
        return self.delays_ms[min(attempt, len(self.delays_ms)) - 1]


def schedule_of(endpoint: Endpoint) -> w.Retry | Schedule:
    """The delays before ``endpoint``'s deliveries' retries: exponential as the core's
    ``Retry`` (full jitter), a list of delays as a ``Schedule``."""
    retry = endpoint.retry
    if isinstance(retry, Exponential):
        return w.Retry(retry.base_ms, retry.cap_ms)
    return Schedule(retry.ms)


Secrets = tuple[tuple[str, int | None], ...]
Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True, repr=False)
class Endpoint:
    """A named receiver of a queue's events and how it is sent to.

    ``types``: dotted event types (``order.paid``, or ``order.*`` for a prefix), empty for
    all; ``secrets``: whsec_ secrets (plain, or ``(secret, until_ms)``), newest first;
    ``rate`` sends a second (None: unlimited) in bursts of ``burst``; ``concurrency`` an
    int or "auto"; ``retry`` ``Exponential`` or ``Delays``; ``success`` "2xx" or "ack";
    ``ordered``: the events of one key one at a time, in enqueue order (its claims hold a
    key while one of its deliveries is in flight or waits for a retry: ``core.lanes``), so
    any ``concurrency`` sends across keys; ``headers``: extra request headers, ``(name,
    value)`` pairs or a dict.
    """

    name: str
    url: str
    types: tuple[str, ...] = ()
    secrets: Secrets = ()
    rate: float | None = None
    burst: int = 1
    concurrency: int | Literal["auto"] = "auto"
    timeout_s: float = 15.0
    retry: Exponential | Delays = field(default_factory=Delays)
    success: str = "2xx"
    ordered: bool = False
    headers: Headers = ()
    allow_networks: tuple[str, ...] = ()
    state: Literal["enabled", "disabled"] = "enabled"
    disabled_reason: str | None = None
    disabled_at_ms: int | None = None
    created_ms: int = 0
    updated_ms: int = 0

    def __post_init__(self) -> None:
        w.check_identifier(self.name, "endpoint name")
        for key, check in FIELDS.items():
            object.__setattr__(self, key, check(getattr(self, key)))
        for key in ("created_ms", "updated_ms"):
            w.check_now(getattr(self, key), key)
        if self.rate is None and self.burst != 1:
            raise ValueError("burst needs a rate (sends a second)")
        self._check_state()

    def _check_state(self) -> None:
        if self.state not in ("enabled", "disabled"):
            raise ValueError(f"state must be 'enabled' or 'disabled': {self.state!r}")
        if self.state == "enabled":
            if (self.disabled_reason, self.disabled_at_ms) != (None, None):
                raise ValueError("an enabled endpoint has no disabled_reason or disabled_at_ms")
            return
        check_reason(self.disabled_reason)
        if self.disabled_at_ms is not None:
            w.check_now(self.disabled_at_ms, "disabled_at_ms")

    def __repr__(self) -> str:
        return f"Endpoint({self.name!r}, {self.url!r}, {len(self.secrets)} secrets, {self.state})"

    @property
    def enabled(self) -> bool:
        return self.state == "enabled"


def _types(value: object) -> tuple[str, ...]:
    items = _sequence(value, "types", MAX_TYPES)
    for item in items:
        if type(item) is not str or len(item) > 128 or not TYPE_RULE.fullmatch(item):
            raise ValueError(
                f"an event type must be dotted names of [A-Za-z0-9_-], optionally ending "
                f"in .* (at most 128 characters): {str(item)[:130]!r}"
            )
    if len(set(items)) < len(items):
        raise ValueError("types lists an event type twice")
    return tuple(items)


def _secrets(value: object) -> Secrets:
    pairs: list[tuple[str, int | None]] = []
    for n, item in enumerate(_sequence(value, "secrets", MAX_SECRETS)):
        secret, until = (item, None) if type(item) is str else _pair(item, f"secrets[{n}]")
        try:
            fingerprint(secret)
        except ValueError as error:
            raise type(error)(f"secrets[{n}]: {error}") from None
        if until is not None:
            w.check_now(until, f"secrets[{n}]'s until_ms")
        pairs.append((secret, until))
    if len({secret for secret, _ in pairs}) < len(pairs):
        raise ValueError("secrets lists a secret twice")
    if pairs and pairs[0][1] is not None:
        raise ValueError("the newest secret (the first) signs until it is rotated out")
    return tuple(pairs)


def _rate(value: object) -> float | None:
    return None if value is None else r.check_rate(value).per_s


def _burst(value: object) -> int:
    return w.check_int(value, "burst", 1, r.MAX_BURST)


def _concurrency(value: object) -> int | Literal["auto"]:
    return (
        "auto"
        if value == "auto" and type(value) is str
        else w.check_int(value, "concurrency", 1, 1024)
    )


def _timeout(value: object) -> float:
    return _seconds(value, "timeout_s", 0, 600, open_low=True)


def _seconds(value: object, name: str, low: float, high: float, *, open_low: bool = False) -> float:
    """An exact int or float of seconds in ``[low, high]`` (``(low, high]``: ``open_low``)."""
    exact = type(value) in (int, float) and isinstance(value, int | float)
    if exact and (low < value if open_low else low <= value) and value <= high:  # type: ignore[operator]
        return float(value)  # type: ignore[arg-type]
    span = f"{'(' if open_low else '['}{low:g}, {high:g}]"
    raise ValueError(f"{name} must be a number of seconds in {span}: {value!r}")


def _retry(value: object) -> Exponential | Delays:
    if type(value) not in (Exponential, Delays):
        raise ValueError(f"retry must be Exponential(base_ms, cap_ms) or Delays(ms): {value!r}")
    return value  # type: ignore[return-value]


def _success(value: object) -> str:
    if value not in SUCCESS_RULES or type(value) is not str:
        raise ValueError(f"success must be 'ack' or '2xx': {value!r}")
    return value


def _ordered(value: object) -> bool:
    if type(value) is not bool:
        raise ValueError(f"ordered must be True or False: {value!r}")
    return value


def _headers(value: object) -> Headers:
    items = list(value.items()) if isinstance(value, Mapping) else value
    pairs = [_pair(item, "a header") for item in _sequence(items, "headers", MAX_HEADERS)]
    seen: set[str] = set()
    for name, text in pairs:
        if type(name) is not str or not HEADER_NAME.fullmatch(name):
            raise ValueError(
                f"a header name must be an HTTP token of 1-64 characters: {str(name)[:70]!r}"
            )
        low = name.lower()
        if low in RESERVED or low.startswith("webhook-"):
            raise ValueError(f"header {name!r} is set by the sender, never by an endpoint")
        if low in seen:
            raise ValueError(f"header {name!r} is given twice")
        seen.add(low)
        if type(text) is not str or not HEADER_VALUE.fullmatch(text):
            raise ValueError(
                f"header {name!r}: a value must be at most 1024 visible ASCII characters and "
                "inner spaces (CR, LF and other control characters are refused)"
            )
    return tuple(pairs)


def _networks(value: object) -> tuple[str, ...]:
    """Networks a sender may reach although they are not globally routable (the address
    guard's allow-list, ``asnackq.wire.guard``): CIDR texts, written canonically."""
    found = []
    for item in _sequence(value, "allow_networks", MAX_NETWORKS):
        try:
            network = ipaddress.ip_network(item, strict=True) if type(item) is str else None
        except ValueError:
            network = None
        if network is None:
            raise ValueError(
                f"allow_networks: not a network such as 10.0.0.0/8: {str(item)[:64]!r}"
            )
        found.append(str(network))
    return tuple(dict.fromkeys(found))


def _url(value: object) -> str:
    if type(value) is not str or len(value) > MAX_URL or not URL_CHARS.fullmatch(value):
        raise ValueError(f"url must be 1-{MAX_URL} visible ASCII characters")
    parts = check_url(value, allow_remote=True)
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not carry a user or password (give credentials in a header)")
    if "#" in value:
        raise ValueError("url must not have a #fragment (it is never sent)")
    return value


def _sequence(value: object, name: str, most: int) -> list[Any]:
    if type(value) not in (tuple, list):
        raise ValueError(f"{name} must be a tuple or list, not {type(value).__name__}")
    items = list(cast("list[Any] | tuple[Any, ...]", value))
    if len(items) > most:
        raise ValueError(f"{name} may hold at most {most} entries, not {len(items)}")
    return items


def _pair(item: object, name: str) -> tuple[Any, Any]:
    if type(item) not in (tuple, list) or len(item) != 2:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a pair")
    return item[0], item[1]  # type: ignore[index]


def check_reason(reason: object) -> str:
    """A disabled endpoint's reason: 1-200 printable characters on one line."""
    if type(reason) is not str or not 1 <= len(reason) <= MAX_REASON or not reason.isprintable():
        raise ValueError(f"a reason must be 1-{MAX_REASON} printable characters on one line")
    return reason


# The fields an update may change, each with its check (which also normalises it).
FIELDS: dict[str, Callable[[Any], Any]] = {
    "url": _url,
    "types": _types,
    "secrets": _secrets,
    "rate": _rate,
    "burst": _burst,
    "concurrency": _concurrency,
    "timeout_s": _timeout,
    "retry": _retry,
    "success": _success,
    "ordered": _ordered,
    "headers": _headers,
    "allow_networks": _networks,
}


def check_change(changes: object, allow_remote: bool) -> dict[str, Any]:
    """An update's fields, each checked (a new url against ``allow_remote`` too)."""
    if type(changes) is not dict:
        raise ValueError("changes must be a dict of field names and values")
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"an update changes {', '.join(FIELDS)}, not {', '.join(map(str, unknown))} "
            "(rename: remove and add; state: disable or enable)"
        )
    checked = {key: FIELDS[key](value) for key, value in changes.items()}
    if "url" in checked:
        check_remote(checked["url"], allow_remote)
    return checked


def check_remote(url: str, allow_remote: bool) -> None:
    host = check_url(url, allow_remote=True).hostname or ""
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing a non-loopback endpoint host without allow_remote: {host!r}")


def hidden(name: str) -> bool:
    """Whether a header's value is a credential, shown by its length only."""
    return SENSITIVE.fullmatch(name) is not None


# --- durations, as the command line and the notes write them ------------------------------

UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": DAY_MS}
DURATION = re.compile(r"([0-9]{1,9})(ms|s|m|h|d)")


def parse_duration(text: str) -> int:
    """``250ms``, ``5s``, ``5m``, ``2h``, ``1d`` in milliseconds."""
    found = DURATION.fullmatch(text)
    if found is None:
        raise ValueError(f"a duration is a whole number and a unit (ms, s, m, h, d): {text!r}")
    return int(found[1]) * UNITS[found[2]]


def duration(ms: int) -> str:
    """Milliseconds in the largest unit that writes them whole: ``5m``, ``1500ms``."""
    for unit in ("d", "h", "m", "s"):
        if ms and ms % UNITS[unit] == 0:
            return f"{ms // UNITS[unit]}{unit}"
    return f"{ms}ms" if ms else "0s"


# --- the tables and their statements --------------------------------------------------------

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS asnackq_endpoints (name TEXT PRIMARY KEY, url TEXT NOT NULL,
  types TEXT NOT NULL, secrets TEXT NOT NULL, rate REAL, burst INTEGER NOT NULL,
  concurrency INTEGER, timeout_s REAL NOT NULL,
  retry_base_ms INTEGER, retry_cap_ms INTEGER, retry_delays TEXT,
  success TEXT NOT NULL CHECK (success IN ('ack', '2xx')),
  ordered INTEGER NOT NULL CHECK (ordered IN (0, 1)), headers TEXT NOT NULL,
  allow_networks TEXT NOT NULL DEFAULT '[]',
  state TEXT NOT NULL CHECK (state IN ('enabled', 'disabled')),
  disabled_reason TEXT, disabled_at_ms INTEGER,
  created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS asnackq_endpoint_changes (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  endpoint TEXT NOT NULL, at_ms INTEGER NOT NULL, action TEXT NOT NULL CHECK (action IN
  ('add', 'update', 'rotate', 'disable', 'enable', 'remove')), note TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS asnackq_endpoint_changes_by_name"
    " ON asnackq_endpoint_changes (endpoint, seq)",
)
# A row's columns: ``types``, ``secrets`` ([[secret, until_ms]]), ``retry_delays`` and
# ``headers`` ([[name, value]]) are JSON; ``concurrency`` NULL is "auto"; ``retry_delays``
# NULL is the exponential retry of ``retry_base_ms`` and ``retry_cap_ms``.
COLUMNS = (
    "name, url, types, secrets, rate, burst, concurrency, timeout_s, retry_base_ms, "
    "retry_cap_ms, retry_delays, success, ordered, headers, allow_networks, state, "
    "disabled_reason, "
    "disabled_at_ms, created_ms, updated_ms"
)
NAMES = COLUMNS.split(", ")
SQL_PRESENT = (
    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'asnackq_endpoints'"
)
SQL_LOCK = f"SELECT {COLUMNS} FROM asnackq_endpoints WHERE name = ?"  # (PostgreSQL: FOR UPDATE)
SQL_READ = f"SELECT {COLUMNS} FROM asnackq_endpoints WHERE name = coalesce(?, name)"
SQL_INSERT = (
    f"INSERT INTO asnackq_endpoints ({COLUMNS}) VALUES ({', '.join(':' + n for n in NAMES)})"
)
SQL_WRITE = (
    "UPDATE asnackq_endpoints SET "
    + ", ".join(f"{n} = :{n}" for n in NAMES[1:])
    + " WHERE name = :name"
)
SQL_DELETE = "DELETE FROM asnackq_endpoints WHERE name = ?"
SQL_AUDIT = (
    "INSERT INTO asnackq_endpoint_changes (endpoint, at_ms, action, note) VALUES (?, ?, ?, ?)"
)
SQL_CHANGES = """SELECT seq, endpoint, at_ms, action, note FROM asnackq_endpoint_changes
WHERE endpoint = coalesce(?, endpoint) ORDER BY seq DESC LIMIT ?"""


class Change(NamedTuple):
    """One audited change of an endpoint."""

    seq: int
    endpoint: str
    at_ms: int
    action: str
    note: str


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def row_of(ep: Endpoint) -> dict[str, Any]:
    """An endpoint as its row's named parameters."""
    delays = ep.retry.ms if isinstance(ep.retry, Delays) else None
    exp = ep.retry if isinstance(ep.retry, Exponential) else None
    return {
        **{key: getattr(ep, key) for key in ("name", "url", "rate", "burst", "timeout_s")},
        "types": _json(ep.types),
        "secrets": _json(ep.secrets),
        "concurrency": None if ep.concurrency == "auto" else ep.concurrency,
        "retry_base_ms": None if exp is None else exp.base_ms,
        "retry_cap_ms": None if exp is None else exp.cap_ms,
        "retry_delays": None if delays is None else _json(delays),
        **{key: getattr(ep, key) for key in ("success", "state", "disabled_reason")},
        "ordered": int(ep.ordered),
        "headers": _json(ep.headers),
        "allow_networks": _json(ep.allow_networks),
        **{key: getattr(ep, key) for key in ("disabled_at_ms", "created_ms", "updated_ms")},
    }


def endpoint_of(row: tuple[Any, ...]) -> Endpoint:
    """The endpoint of a row; one ``ValueError`` line for a row out of range (written by
    hand, or by something else), never a secret."""
    got = dict(zip(NAMES, row, strict=True))
    try:
        delays = got["retry_delays"]
        return Endpoint(
            **{key: got[key] for key in ("name", "url", "burst", "success", "state")},
            types=tuple(json.loads(got["types"])),
            secrets=tuple(tuple(pair) for pair in json.loads(got["secrets"])),
            rate=None if got["rate"] is None else float(got["rate"]),
            concurrency="auto" if got["concurrency"] is None else got["concurrency"],
            timeout_s=float(got["timeout_s"]),
            retry=Exponential(got["retry_base_ms"], got["retry_cap_ms"])
            if delays is None
            else Delays(tuple(json.loads(delays))),
            ordered=got["ordered"] == 1,
            headers=tuple(tuple(pair) for pair in json.loads(got["headers"])),
            allow_networks=tuple(json.loads(got["allow_networks"])),
            **{key: got[key] for key in ("disabled_reason", "disabled_at_ms")},
            **{key: got[key] for key in ("created_ms", "updated_ms")},
        )
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"the endpoint row {str(got['name'])[:64]!r} is out of range: {error}"
        ) from None


# --- what a change's note says -------------------------------------------------------------


def shown(key: str, value: Any) -> str:
    """A field as a note writes it (secrets as fingerprints, headers by name)."""
    if key == "secrets":
        return (
            "["
            + ", ".join(fingerprint(s) + ("" if u is None else f" until {u}") for s, u in value)
            + "]"
        )
    if key == "headers":
        return "[" + ", ".join(name for name, _ in value) + "]"
    if key == "types":
        return ",".join(value) or "all"
    if key == "retry":
        if isinstance(value, Delays):
            return ",".join(duration(ms) for ms in value.ms)
        return f"exponential {duration(value.base_ms)}..{duration(value.cap_ms)}"
    if key == "rate":
        return "unlimited" if value is None else f"{value:g}/s"
    return str(value)


def described(ep: Endpoint) -> str:
    return "; ".join(f"{key} {shown(key, getattr(ep, key))}" for key in FIELDS)


def differences(old: Endpoint, new: Endpoint) -> str:
    said = []
    for key in FIELDS:
        before, after = getattr(old, key), getattr(new, key)
        if before == after:
            continue
        said.append(f"{key} {shown(key, before)} -> {shown(key, after)}")
        if key == "headers":
            names = {n for n, _ in before} & {n for n, _ in after}
            changed = sorted(n for n in names if dict(before)[n] != dict(after)[n])
            said[-1] += f" (values changed: {', '.join(changed)})" if changed else ""
    return "; ".join(said)


# --- plans ------------------------------------------------------------------------------


def _tables() -> w.Plan[None]:
    for statement in SCHEMA:
        yield w.Sql(statement)
    return None, True


def _audit(name: str, now_ms: int, action: str, note: str) -> w.Plan[None]:
    yield from w.write_one(SQL_AUDIT, (name, now_ms, action, note))
    return None, True


def _locked(name: str) -> w.Plan[Endpoint]:
    """The tables (made if absent), then the row of ``name``, locked for the change."""
    yield from _tables()
    rows = yield w.Sql(SQL_LOCK, (name,))
    if not rows:
        raise NoSuchEndpoint(f"no endpoint {name!r} in this queue")
    return endpoint_of(rows[0]), False


def plan_add(endpoint: object, now_ms: object, *, allow_remote: bool = False) -> w.Plan[Endpoint]:
    """Plan adding ``endpoint`` (result: the endpoint as stored, its times set);
    ``EndpointExists`` if the name is taken."""
    if type(endpoint) is not Endpoint:
        raise ValueError(f"endpoint must be an Endpoint: {type(endpoint).__name__}")
    now = w.check_now(now_ms)
    check_remote(endpoint.url, allow_remote)
    at = (
        now
        if endpoint.state == "disabled" and endpoint.disabled_at_ms is None
        else endpoint.disabled_at_ms
    )
    return _add(dataclasses.replace(endpoint, created_ms=now, updated_ms=now, disabled_at_ms=at))


def _add(ep: Endpoint) -> w.Plan[Endpoint]:
    yield from _tables()
    if (yield w.Sql(SQL_LOCK, (ep.name,))):
        raise EndpointExists(f"endpoint {ep.name!r} exists already (change it with an update)")
    yield from w.write_one(SQL_INSERT, row_of(ep))
    yield from _audit(ep.name, ep.created_ms, "add", described(ep))
    return ep, True


def _changed(old: Endpoint, new: Endpoint, action: str, note: str) -> w.Plan[Endpoint]:
    yield from w.write_one(SQL_WRITE, row_of(new))
    yield from _audit(new.name, new.updated_ms, action, note)
    return new, True


def plan_update(
    name: object, changes: object, now_ms: object, *, allow_remote: bool = False
) -> w.Plan[Endpoint]:
    """Plan changing fields of an endpoint (result: the endpoint now)."""
    args = w.check_identifier(name, "endpoint name"), check_change(changes, allow_remote)
    return _update(*args, w.check_now(now_ms))


def _update(name: str, changes: dict[str, Any], now_ms: int) -> w.Plan[Endpoint]:
    old, _ = yield from _locked(name)
    new = dataclasses.replace(old, **changes)
    if new == old:
        return old, False
    new = dataclasses.replace(new, updated_ms=now_ms)
    return (yield from _changed(old, new, "update", differences(old, new)))


def plan_rotate(
    name: object, secret: object, now_ms: object, overlap_s: object = 86_400
) -> w.Plan[Endpoint]:
    """Plan a new secret for an endpoint: it signs from now, and the ones it replaces keep
    signing beside it for ``overlap_s`` (0..30 days)."""
    fingerprint(secret)  # (BadSecret, never repeating it)
    overlap_ms = math.floor(_seconds(overlap_s, "overlap_s", 0, MAX_OVERLAP_S) * 1000)
    name = w.check_identifier(name, "endpoint name")
    return _rotate(name, cast(str, secret), w.check_now(now_ms), overlap_ms)


def _rotate(name: str, secret: str, now_ms: int, overlap_ms: int) -> w.Plan[Endpoint]:
    old, _ = yield from _locked(name)
    secrets = rotated(old.secrets, secret, now_ms, overlap_ms)
    if len(secrets) > MAX_SECRETS:
        raise ValueError(f"an endpoint keeps at most {MAX_SECRETS} secrets signing at once")
    new = dataclasses.replace(old, secrets=secrets, updated_ms=now_ms)
    note = f"{fingerprint(secret)} signs from now; " + (
        ", ".join(f"{fingerprint(s)} until {u}" for s, u in secrets[1:]) or "no other secret"
    )
    return (yield from _changed(old, new, "rotate", note))


def plan_disable(name: object, reason: object, now_ms: object) -> w.Plan[bool]:
    """Plan disabling an endpoint for ``reason`` (result: False if it already was)."""
    args = w.check_identifier(name, "endpoint name"), check_reason(reason), w.check_now(now_ms)
    return _disable(*args)


def _disable(name: str, reason: str, now_ms: int) -> w.Plan[bool]:
    old, _ = yield from _locked(name)
    if not old.enabled:
        return False, False
    new = dataclasses.replace(
        old, state="disabled", disabled_reason=reason, disabled_at_ms=now_ms, updated_ms=now_ms
    )
    yield from _changed(old, new, "disable", reason)
    return True, True


def plan_enable(name: object, now_ms: object) -> w.Plan[bool]:
    """Plan enabling an endpoint (result: False if it already was)."""
    return _enable(w.check_identifier(name, "endpoint name"), w.check_now(now_ms))


def _enable(name: str, now_ms: int) -> w.Plan[bool]:
    old, _ = yield from _locked(name)
    if old.enabled:
        return False, False
    new = dataclasses.replace(
        old, state="enabled", disabled_reason=None, disabled_at_ms=None, updated_ms=now_ms
    )
    yield from _changed(
        old, new, "enable", f"disabled since {old.disabled_at_ms}: {old.disabled_reason}"
    )
    return True, True


def plan_remove(name: object, now_ms: object) -> w.Plan[Endpoint]:
    """Plan removing an endpoint (result: the endpoint removed); its changes stay."""
    return _remove(w.check_identifier(name, "endpoint name"), w.check_now(now_ms))


def _remove(name: str, now_ms: int) -> w.Plan[Endpoint]:
    old, _ = yield from _locked(name)
    yield from w.write_one(SQL_DELETE, (name,))
    yield from _audit(name, now_ms, "remove", described(old))
    return old, True


# Read plans: statements only, no write; a queue without the tables has no endpoints.


def _present() -> w.Plan[bool]:
    rows = yield w.Sql(SQL_PRESENT)
    return bool(rows and rows[0][0]), False


def plan_list() -> w.Plan[list[Endpoint]]:
    """Plan reading every endpoint, by name."""
    if not (yield from _present())[0]:
        return [], False
    rows = yield w.Sql(SQL_READ, (None,))
    return sorted((endpoint_of(row) for row in rows or []), key=lambda ep: ep.name), False


def plan_get(name: object) -> w.Plan[Endpoint]:
    """Plan reading one endpoint (``NoSuchEndpoint`` if the queue has none of that name)."""
    return _get(w.check_identifier(name, "endpoint name"))


def _get(name: str) -> w.Plan[Endpoint]:
    rows = (yield w.Sql(SQL_READ, (name,))) if (yield from _present())[0] else None
    if not rows:
        raise NoSuchEndpoint(f"no endpoint {name!r} in this queue")
    return endpoint_of(rows[0]), False


def plan_changes(name: object = None, limit: object = 20) -> w.Plan[list[Change]]:
    """Plan reading the last ``limit`` (1..1000) changes, newest first: of the endpoint
    ``name`` (a removed one's too), or of all."""
    if name is not None:
        w.check_identifier(name, "endpoint name")
    return _changes(name, w.check_int(limit, "limit", 1, 1000))  # type: ignore[arg-type]


def _changes(name: str | None, limit: int) -> w.Plan[list[Change]]:
    if not (yield from _present())[0]:
        return [], False
    rows = yield w.Sql(SQL_CHANGES, (name, limit))
    return [Change(*row) for row in rows or []], False
