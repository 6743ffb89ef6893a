"""The endpoint commands: add, list, show, update, rotate-secret, disable, enable, remove,
changes.

Every option is checked (the endpoint built, or the change checked, by
``asnackq.core.endpoints``) before the queue is opened: a refusal is one usage line (exit
2) and writes nothing.  A name that is taken (add) or unknown is exit 1.  A secret is
printed once, by ``add --new-secret`` or ``rotate-secret --new-secret``; everything else
shows a secret as its fingerprint and a credential header by its length.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, cast

from rich.console import Console
from rich.markup import escape

from asnackq.cli.common import (
    QUEUE_HELP,
    TIMEOUT,
    Commands,
    Usage,
    concurrency_arg,
    existing_queue,
    renamed,
    target,
    within,
)
from asnackq.cli.render import emit, iso, key_values, rows_table
from asnackq.core import endpoints as ep
from asnackq.core import rate as r
from asnackq.core import worker as w
from asnackq.core.endpoints import Change, Delays, Endpoint, Exponential
from asnackq.core.receivers import SUCCESS_RULES, fingerprint
from asnackq.store import readers, reads, sessions
from asnackq.store.targets import Target, is_url
from asnackq.wire.webhooks import new_secret, read_secrets

__all__ = ["add_endpoint"]

T = TypeVar("T")


def add_endpoint(commands: Commands) -> None:
    endpoint = commands.add_parser(
        "endpoint",
        help="a queue's named endpoints: add, list, show, update, rotate-secret, disable, "
        "enable, remove, changes",
        description="Manage the endpoints a queue delivers to; every change is audited "
        "(see 'asnackq endpoint changes' and 'show').",
    )
    actions = endpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = named(
        actions, "add", "add an endpoint (its URL checked; a remote host needs --allow-remote)"
    )
    add.add_argument("--url", required=True, help="http(s)://HOST[:PORT]/PATH")
    add_settings(add, update=False)
    add_secret_source(add, "sign with each whsec_ secret in FILE, one a line", required=False)
    add.set_defaults(run=run_add)

    listing = actions.add_parser("list", help="the queue's endpoints (secrets never shown)")
    listing.add_argument("queue", type=target, help=QUEUE_HELP)
    listing.add_argument("--json", action="store_true", help="print the endpoints as JSON")
    listing.set_defaults(run=run_list)

    show = named(actions, "show", "one endpoint and its last changes (secrets never shown)")
    show.add_argument("--changes", type=within(int, 1, 1000), default=10, help="changes listed")
    show.set_defaults(run=run_show)

    update = named(actions, "update", "change an endpoint's settings (only the options given)")
    update.add_argument("--url", default=None, help="http(s)://HOST[:PORT]/PATH")
    add_settings(update, update=True)
    update.set_defaults(run=run_update)

    rotate = named(
        actions, "rotate-secret", "sign with a new secret; the old ones sign beside it a while"
    )
    add_secret_source(rotate, "the new whsec_ secret: the one line of FILE", required=True)
    rotate.add_argument(
        "--overlap-s",
        type=within(float, 0, ep.MAX_OVERLAP_S),
        default=86_400.0,
        help="how long the replaced secrets keep signing",
    )
    rotate.set_defaults(run=run_rotate)

    disable = named(actions, "disable", "send the endpoint nothing until it is enabled")
    disable.add_argument("--reason", required=True, help="why (1-200 printable characters)")
    disable.set_defaults(run=run_disable)
    named(actions, "enable", "send to the endpoint again").set_defaults(run=run_enable)
    named(actions, "remove", "remove an endpoint (its changes stay)").set_defaults(run=run_remove)

    changes = actions.add_parser("changes", help="the audited changes, newest first")
    changes.add_argument("queue", type=target, help=QUEUE_HELP)
    changes.add_argument("name", nargs="?", help="one endpoint's (a removed one's too)")
    changes.add_argument("--limit", type=within(int, 1, 1000), default=20, help="changes listed")
    changes.add_argument("--json", action="store_true", help="print the changes as JSON")
    changes.set_defaults(run=run_changes)


def named(actions: Commands, action: str, text: str) -> argparse.ArgumentParser:
    """An action on one endpoint: ``QUEUE NAME``, and ``--json``."""
    parser = actions.add_parser(action, help=text)
    parser.add_argument("queue", type=target, help=QUEUE_HELP)
    parser.add_argument("name", help="the endpoint's name ([A-Za-z0-9_-]{1,64})")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def add_settings(parser: argparse.ArgumentParser, update: bool) -> None:
    """The settings ``add`` takes and ``update`` changes (given ones only, for ``update``)."""
    keep = " (default: unchanged)" if update else ""
    parser.add_argument("--types", help="event types it takes, a.b,c.* (empty: all)" + keep)
    parser.add_argument("--rate", help="sends a second, or 'off': unlimited" + keep)
    parser.add_argument("--burst", type=within(int, 1, r.MAX_BURST), help="with --rate" + keep)
    parser.add_argument("--concurrency", type=concurrency_arg, help="1..1024 or auto" + keep)
    # (as ``asnackq work --timeout-s``: a wait of a nanosecond times every send out, and a
    # send that timed out spends no attempt)
    parser.add_argument("--timeout-s", type=TIMEOUT, help="an answer's wait" + keep)
    parser.add_argument("--retry-base-ms", type=within(int, 1, ep.MAX_DELAY_MS))
    parser.add_argument("--retry-cap-ms", type=within(int, 1, ep.MAX_DELAY_MS))
    parser.add_argument(
        "--retry-delays", help="waits before each retry, such as 0s,5s,5m,30m,2h,5h,10h,10h" + keep
    )
    parser.add_argument(
        "--success", choices=SUCCESS_RULES, help="any 2xx, or the sink's ACK" + keep
    )
    parser.add_argument(
        "--ordered",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the events of one key one at a time, in enqueue order" + keep,
    )
    parser.add_argument(
        "--header",
        action="append",
        metavar="'NAME: VALUE'",
        help="a request header (repeat for more)" + (": replaces them all" if update else ""),
    )
    if update:
        parser.add_argument("--no-headers", action="store_true", help="remove every header")
    parser.add_argument(
        "--allow-network",
        action="append",
        metavar="CIDR",
        help="a network a worker may send to although it is not globally routable (the "
        "address guard of a worker run with --allow-remote; repeat for more)"
        + (": replaces them all" if update else ""),
    )
    if update:
        parser.add_argument(
            "--no-allow-networks", action="store_true", help="remove every allowed network"
        )
    parser.add_argument(
        "--allow-remote", action="store_true", help="a URL whose host is not loopback"
    )


def add_secret_source(parser: argparse.ArgumentParser, text: str, required: bool) -> None:
    """``--secret-file FILE`` or ``--new-secret`` (one of them, when ``required``)."""
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--secret-file", default=None, metavar="FILE", help=text)
    source.add_argument(
        "--new-secret", action="store_true", help="generate one, printed once on stdout"
    )


# --- options into values, checked before anything is opened ----------------------------


def usage(check: Callable[[], T]) -> T:
    """``check()``, a ``ValueError`` as a usage error."""
    try:
        return check()
    except ValueError as error:
        raise Usage(renamed(error, FLAGS)) from None


FLAGS = {"allow_remote": "--allow-remote", "timeout_s": "--timeout-s", "overlap_s": "--overlap-s"}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, as an endpoint's fields."""
    given: dict[str, Any] = {}
    if args.url is not None:
        given["url"] = args.url
    if args.types is not None:
        given["types"] = tuple(args.types.split(",")) if args.types else ()
    if args.rate is not None:
        given["rate"] = None if args.rate == "off" else usage(lambda: number(args.rate, "--rate"))
    for key in ("burst", "concurrency", "timeout_s", "success", "ordered"):
        if getattr(args, key) is not None:
            given[key] = getattr(args, key)
    retry = retry_of(args)
    if retry is not None:
        given["retry"] = retry
    if args.header is not None or getattr(args, "no_headers", False):
        if args.header is not None and getattr(args, "no_headers", False):
            raise Usage("--header and --no-headers do not go together")
        given["headers"] = tuple(header(text) for text in args.header or ())
    if args.allow_network is not None or getattr(args, "no_allow_networks", False):
        if args.allow_network is not None and getattr(args, "no_allow_networks", False):
            raise Usage("--allow-network and --no-allow-networks do not go together")
        given["allow_networks"] = tuple(args.allow_network or ())
    return given


def number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number of sends a second, or 'off': {text!r}") from None


def retry_of(args: argparse.Namespace) -> Exponential | Delays | None:
    exponential = (args.retry_base_ms, args.retry_cap_ms)
    if args.retry_delays is not None:
        if exponential != (None, None):
            raise Usage("--retry-delays and --retry-base-ms/--retry-cap-ms do not go together")
        waits = [
            0 if text == "0" else usage(partial(ep.parse_duration, text))
            for text in args.retry_delays.split(",")
        ]
        return usage(lambda: Delays(tuple(waits)))
    if exponential == (None, None):
        return None
    if None in exponential:
        raise Usage("--retry-base-ms and --retry-cap-ms go together")
    return usage(lambda: Exponential(*exponential))


def header(text: str) -> tuple[str, str]:
    """``'Name: value'`` as a pair (the value's surrounding spaces dropped)."""
    name, colon, value = text.partition(":")
    if not colon:
        raise Usage("--header must be 'NAME: VALUE'")
    return name, value.strip(" \t")


def secrets_of(args: argparse.Namespace) -> list[str]:
    """The secrets of ``--secret-file`` (checked now, never repeated), or a new one."""
    if args.new_secret:
        return [new_secret()]
    if args.secret_file is None:
        return []
    try:
        return list(read_secrets(args.secret_file))
    except ValueError as error:  # (a file that cannot be read, too: one line)
        raise Usage(f"--secret-file: {error}") from None


# --- running -----------------------------------------------------------------------------


def change(queue: Target, make: Callable[[], w.Plan[Any]]) -> Any:
    """Run a change's plan (validated already) on an existing queue."""
    existing_queue(queue)
    with sessions.open_session(queue) as store:
        return store.run(make)


def read(queue: Target, make: Callable[[], w.Plan[Any]]) -> Any:
    """Run a read plan without a write: a file opened read-only, a URL in a read-only
    session (whose statements have their PostgreSQL texts)."""
    if is_url(queue):
        with sessions.pg_read_only(str(queue), "jobs", "queue") as reader:
            return cast(sessions.Session, reader).run(make)
    with readers.read_only(queue, "jobs") as con:
        return reads.run(con, make())


def run_add(args: argparse.Namespace) -> int:
    given = settings(args)
    secrets = secrets_of(args)
    endpoint = usage(
        lambda: Endpoint(args.name, secrets=tuple((s, None) for s in secrets), **given)
    )
    now = w.epoch_ms()
    make = partial(ep.plan_add, endpoint, now, allow_remote=args.allow_remote)
    usage(lambda: make().close())  # (a remote host without --allow-remote, say)
    stored: Endpoint = change(args.queue, make)
    shown = {"endpoint": view(stored)} | ({"secret": secrets[0]} if args.new_secret else {})

    def human(out: Console) -> None:
        out.print(f"added endpoint {stored.name} -> {escape(stored.url)}")
        if args.new_secret:
            out.print(f"its secret (shown this once; keep it): {secrets[0]}", soft_wrap=True)

    emit(args, shown, human)
    return 0


def run_update(args: argparse.Namespace) -> int:
    given = settings(args)
    if not given:
        raise Usage("give at least one setting to change (see --help)")
    usage(lambda: ep.check_change(given, args.allow_remote))
    now = w.epoch_ms()
    make = partial(ep.plan_update, args.name, given, now, allow_remote=args.allow_remote)
    updated: Endpoint = change(args.queue, make)
    changed = updated.updated_ms == now
    emit(
        args,
        {"endpoint": view(updated), "changed": changed},
        lambda out: out.print(
            f"{'updated' if changed else 'nothing to change in'} endpoint {updated.name}"
        ),
    )
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    secrets = secrets_of(args)
    if len(secrets) != 1:
        raise Usage("--secret-file must hold exactly one whsec_ secret to rotate to")
    make = partial(ep.plan_rotate, args.name, secrets[0], w.epoch_ms(), args.overlap_s)
    usage(lambda: make().close())
    rotated: Endpoint = change(args.queue, make)
    shown = {"endpoint": view(rotated)} | ({"secret": secrets[0]} if args.new_secret else {})

    def human(out: Console) -> None:
        out.print(f"endpoint {rotated.name} signs with {fingerprint(secrets[0])} from now")
        for entry in view(rotated)["secrets"][1:]:
            out.print(f"  {entry['fingerprint']} signs until {entry['until']}")
        if args.new_secret:
            out.print(f"its secret (shown this once; keep it): {secrets[0]}", soft_wrap=True)

    emit(args, shown, human)
    return 0


def run_state(args: argparse.Namespace, make: Callable[[], w.Plan[bool]], done: str) -> int:
    usage(lambda: make().close())
    changed: bool = change(args.queue, make)
    emit(
        args,
        {"name": args.name, "changed": changed},
        lambda out: out.print(f"{done if changed else 'already ' + done.split()[0]} {args.name}"),
    )
    return 0


def run_disable(args: argparse.Namespace) -> int:
    make = partial(ep.plan_disable, args.name, args.reason, w.epoch_ms())
    return run_state(args, make, "disabled endpoint")


def run_enable(args: argparse.Namespace) -> int:
    make = partial(ep.plan_enable, args.name, w.epoch_ms())
    return run_state(args, make, "enabled endpoint")


def run_remove(args: argparse.Namespace) -> int:
    make = partial(ep.plan_remove, args.name, w.epoch_ms())
    usage(lambda: make().close())
    removed: Endpoint = change(args.queue, make)
    emit(args, {"removed": removed.name}, lambda out: out.print(f"removed endpoint {removed.name}"))
    return 0


def run_list(args: argparse.Namespace) -> int:
    found: list[Endpoint] = read(args.queue, ep.plan_list)
    rows = [view(one) for one in found]
    columns = ("name", "state", "url", "types", "secrets", "concurrency", "retry")
    shown = [{key: escape(text(key, row[key])) for key in columns} for row in rows]
    emit(
        args,
        {"endpoints": rows},
        lambda out: out.print(rows_table(f"{len(rows)} endpoints", shown, columns)),
    )
    return 0


def run_show(args: argparse.Namespace) -> int:
    usage(lambda: ep.plan_get(args.name).close())
    one: Endpoint = read(args.queue, partial(ep.plan_get, args.name))
    changes: list[Change] = read(args.queue, partial(ep.plan_changes, args.name, args.changes))
    data: dict[str, Any] = {"endpoint": view(one), "changes": [change_view(c) for c in changes]}

    def human(out: Console) -> None:
        pairs = [(key, escape(text(key, value))) for key, value in data["endpoint"].items()]
        out.print(key_values(f"endpoint {one.name}", pairs))
        out.print(changes_table(changes))

    emit(args, data, human)
    return 0


def run_changes(args: argparse.Namespace) -> int:
    make = partial(ep.plan_changes, args.name, args.limit)
    usage(lambda: make().close())
    changes: list[Change] = read(args.queue, make)
    emit(
        args,
        {"changes": [change_view(c) for c in changes]},
        lambda out: out.print(changes_table(changes)),
    )
    return 0


# --- rendering: never a secret -------------------------------------------------------------


def view(one: Endpoint) -> dict[str, Any]:
    """An endpoint as the commands show it: each secret as its fingerprint, a credential
    header's value as its length."""
    retry = one.retry
    return {
        "name": one.name,
        "url": one.url,
        "types": list(one.types) or "all",
        "secrets": [
            {"fingerprint": fingerprint(secret), "until_ms": until, "until": iso(until)}
            for secret, until in one.secrets
        ],
        "rate": one.rate,
        "burst": one.burst,
        "concurrency": one.concurrency,
        "timeout_s": one.timeout_s,
        "retry": {"delays_ms": list(retry.ms)}
        if isinstance(retry, Delays)
        else {"base_ms": retry.base_ms, "cap_ms": retry.cap_ms},
        "success": one.success,
        "ordered": one.ordered,
        "headers": [
            {"name": name, "value": None, "chars": len(value)}
            if ep.hidden(name)
            else {"name": name, "value": value}
            for name, value in one.headers
        ],
        "allow_networks": list(one.allow_networks),
        "state": one.state,
        "disabled_reason": one.disabled_reason,
        "disabled_at": iso(one.disabled_at_ms),
        "created": iso(one.created_ms),
        "updated": iso(one.updated_ms),
    }


def text(key: str, value: Any) -> str:
    """A field of ``view`` on one line of a terminal."""
    if key == "secrets" and isinstance(value, list):
        return (
            ", ".join(
                s["fingerprint"] + ("" if s["until"] is None else f" until {s['until']}")
                for s in value
            )
            or "none (unsigned)"
        )
    if key == "headers":
        return (
            ", ".join(
                f"{h['name']}: "
                + (f"(hidden, {h['chars']} characters)" if h["value"] is None else h["value"])
                for h in value
            )
            or "-"
        )
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return "-" if value is None else str(value)


def change_view(one: Change) -> dict[str, Any]:
    return {**one._asdict(), "at": iso(one.at_ms)}


def changes_table(changes: list[Change]) -> Any:
    rows = [{key: escape(str(v)) for key, v in change_view(c).items()} for c in changes]
    return rows_table(f"{len(rows)} changes", rows, ("at", "endpoint", "action", "note"))
