"""What every command shares: failures and exit codes, argparse types, the queue-file rule."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import re
import signal
import sys
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeAlias, TypedDict

from asnackq.core.receivers import SUCCESS_RULES, check_url, is_loopback
from asnackq.sink import capacity, faults
from asnackq.store import sessions
from asnackq.store.targets import Target, is_url, parse_target, shown
from asnackq.wire import logs
from asnackq.wire.guard import Guard, Network, aiohttp_host, network
from asnackq.wire.logs import FORMATS
from asnackq.wire.tls import tls_context
from asnackq.wire.webhooks import read_secrets

__all__ = [
    "DELAY_MS",
    "FLOAT_TEXT",
    "PROBABILITY",
    "QUEUE_HELP",
    "TIMEOUT",
    "Command",
    "Commands",
    "Failure",
    "Parser",
    "SinkTls",
    "Usage",
    "add_allow_network",
    "add_db_wait",
    "add_faults",
    "add_files",
    "add_log_format",
    "add_metrics_options",
    "add_receiver_rules",
    "add_sink_tls",
    "add_tls_files",
    "check_sink",
    "complete_help",
    "ended",
    "exact_int",
    "existing_queue",
    "log_to_stderr",
    "port",
    "receiver_rules",
    "renamed",
    "setting_up",
    "sink_tls",
    "sink_url",
    "stop_signals",
    "target",
    "wait_for_database",
    "within",
]

Command = Callable[[argparse.Namespace], int]


class Failure(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 1."""


class Usage(Failure):
    """Options that do not go together: printed as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``asnackq COMMAND: why``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


Commands: TypeAlias = "argparse._SubParsersAction[Parser]"


QUEUE_HELP = "a queue file, or a postgresql:// URL"


def target(text: str) -> Target:
    """An argparse type: a file path, or a ``postgresql://`` URL (``targets.parse_target``)."""
    try:
        return parse_target(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def file_only(text: str) -> Path:
    """An argparse type: a SQLite file's path, where no URL is taken (one is refused, and
    never echoed: it may hold a password)."""
    found = target(text)
    if not isinstance(found, Path):
        raise argparse.ArgumentTypeError("must be a SQLite file here, not a PostgreSQL URL")
    return found


def existing_queue(path: Target) -> Target:
    """A queue that must already exist (``init`` creates one; typos create nothing)."""
    try:
        sessions.require(path)
    except ValueError as error:
        raise Failure(str(error)) from None
    return path


# Numbers on the command line are ASCII, written plainly: no spaces, "+", "_" or other
# scripts' digits (which int() and float() would take).
INT_TEXT = re.compile(r"-?[0-9]{1,19}")
FLOAT_TEXT = re.compile(r"-?(?:[0-9]{1,19}(?:\.[0-9]{0,19})?|\.[0-9]{1,19})(?:[eE]-?[0-9]{1,3})?")


def exact_int(text: str) -> int:
    """An argparse type: an int in ASCII digits (an optional minus), nothing else."""
    if not INT_TEXT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be an int, not {text!r}")
    return int(text)


def concurrency_arg(text: str) -> int | str:
    """An argparse type: ``auto``, or an int (its range is the Dispatcher's)."""
    return text if text == "auto" else exact_int(text)


def within(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` (int, or a finite float) in ``low..high``."""
    pattern = INT_TEXT if kind is int else FLOAT_TEXT

    def parse(text: str) -> int | float:
        value = kind(text) if pattern.fullmatch(text) else math.nan  # nan fails the range
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be {'an int' if kind is int else 'a number'} in {low}..{high}, not {text!r}"
            )
        return value

    parse.span = (low, high)  # type: ignore[attr-defined]  # (read by complete_help)
    return parse


def complete_help(parser: argparse.ArgumentParser) -> None:
    """Every command has a description (its one-line help, if it has none of its own), and
    every option's help ends with its range (from a ``within`` type) and its default, unless
    it says them already."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, command in action.choices.items():
                if not command.description and helps.get(name):
                    command.description = helps[name][:1].upper() + helps[name][1:] + "."
                complete_help(command)
            continue
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        text, said = action.help or "", []
        span = getattr(action.type, "span", None)
        if span is not None and ".." not in text:
            said.append(f"{plain(span[0])}..{plain(span[1])}")
        default = action.default
        unset = default is None or isinstance(default, bool) or default == argparse.SUPPRESS
        if not unset and "default" not in text:
            said.append(f"default {plain(default)}")
        if said:
            action.help = f"{text} ({'; '.join(said)})" if text else "; ".join(said)


def add_faults(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """A sink's injected faults, ``--fail-rate`` and ``--drop-rate`` (``whose``: ``"the
    sink "`` when the options are another command's)."""
    parser.add_argument(
        "--fail-rate", type=PROBABILITY, default=0.0, help=f"{whose}answer 503 before any change"
    )
    parser.add_argument(
        "--drop-rate",
        type=PROBABILITY,
        default=0.0,
        help=f"{whose}commit, then close the connection without an answer",
    )


def plain(value: object) -> str:
    """A number as a person writes it: ``1000000``, ``0.5``, not ``1e+06``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


PROBABILITY = within(float, *faults.PROBABILITY)  # a sink's fault rate (a probability)
DELAY_MS = within(int, *faults.DELAY_MS)  # a sink's delay before each answer
TIMEOUT = within(float, 0.001, 600)  # a sender's timeout_s
MAX_INFLIGHT = within(int, *capacity.MAX_INFLIGHT)  # a sink's events in a handler at once
SINK_RATE = within(float, 0.001, capacity.SINK_RATES[1])  # a sink's events per second


def check_sink(url: str, allow_remote: bool, allow: Sequence[Network] = ()) -> None:
    """Refuse (usage) a non-loopback sink unless ``--allow-remote`` was given,
    ``--allow-network`` without it, and a sink written as an address the guard refuses
    (``asnackq.wire.guard``: not globally routable, nor in an ``--allow-network``)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if not allow_remote and not is_loopback(host):
        raise Usage(f"refusing non-loopback sink {host!r} without --allow-remote")
    if allow and not allow_remote:
        raise Usage("--allow-network goes with --allow-remote")
    why = Guard(allow).verdict(host) if allow_remote else None
    if why is not None:
        raise Usage(f"refusing sink {host!r}: {why} (allow its network with --allow-network)")


def allow_network(text: str) -> Network:
    """An argparse type: a network (``10.0.0.0/8``, ``fd00::/8``; an address alone is
    itself), its host bits clear."""
    try:
        return network(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_allow_network(parser: argparse.ArgumentParser) -> None:
    """``--allow-network``: networks a remote sink may be in although not globally routable."""
    parser.add_argument(
        "--allow-network",
        type=allow_network,
        action="append",
        default=[],
        metavar="CIDR",
        help="with --allow-remote: let sends reach this network (repeatable; such as "
        "10.0.0.0/8; default: none). Without it a sink's every address must be globally routable: "
        "loopback, private, link-local, unique-local, multicast and cloud metadata "
        "addresses are refused, checked on every connection",
    )


def sink_url(text: str) -> str:
    """An argparse type: an http(s) URL with a host and a valid port (the loopback rule
    is applied later, with ``--allow-remote``)."""
    try:
        check_url(text, allow_remote=True)
        if not aiohttp_host(text):  # (raises for what the standard library reads, yarl not)
            raise ValueError(f"url must be http(s)://HOST[:PORT]/PATH: {text!r}")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_files(parser: argparse.ArgumentParser, helps: dict[str, str]) -> None:
    """Options naming a file each (``--flag FILE``), absent by default."""
    for flag, text in helps.items():
        parser.add_argument(flag, type=Path, default=None, metavar="FILE", help=text)


def add_sink_tls(parser: argparse.ArgumentParser) -> None:
    """The options of a command that sends to an https:// sink."""
    add_files(
        parser,
        {
            "--sink-ca": "trust only the CAs in this PEM file (default: the system's trust store)",
            "--sink-cert": "a client certificate (PEM)",
            "--sink-key": "its private key (PEM; default: in --sink-cert)",
        },
    )


def add_receiver_rules(parser: argparse.ArgumentParser) -> None:
    """The options of a command that sends: what proves a delivery, and what signs it."""
    parser.add_argument(
        "--success",
        choices=SUCCESS_RULES,
        default=None,
        help="what proves a delivery: the sink's verified ACK (default), or any 2xx answer "
        "within --timeout-s (an ordinary webhook receiver)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="sign every send (Standard Webhooks: webhook-id, webhook-timestamp, "
        "webhook-signature) with each whsec_ secret in FILE, one per line",
    )


class ReceiverRules(TypedDict):
    """A sender's ``success`` rule and ``secrets``."""

    success: str
    secrets: list[str] | None


def receiver_rules(args: argparse.Namespace) -> ReceiverRules:
    """``add_receiver_rules``'s options, the secret file read and checked now (a usage
    error names the line, never its text)."""
    if args.secret_file is None:
        return ReceiverRules(success=args.success or "ack", secrets=None)
    try:
        secrets = read_secrets(args.secret_file)
    except ValueError as error:
        raise Usage(f"--secret-file: {error}") from None
    return ReceiverRules(success=args.success or "ack", secrets=list(secrets))


class SinkTls(TypedDict):
    """A sender's TLS files (its ``ca_file``, ``cert_file`` and ``key_file`` arguments)."""

    ca_file: Path | None
    cert_file: Path | None
    key_file: Path | None


def sink_tls(args: argparse.Namespace) -> SinkTls:
    """The sender's TLS options from ``add_sink_tls``'s, checked now (a usage error:
    exit 2), before any file is opened."""
    files = SinkTls(ca_file=args.sink_ca, cert_file=args.sink_cert, key_file=args.sink_key)
    sink = getattr(args, "sink", None)  # (None: an endpoint's URL, read when the run starts)
    try:
        tls_context("https" if sink is None else sink.split(":", 1)[0], **files)
    except ValueError as error:
        flags = {"ca_file": "--sink-ca", "cert_file": "--sink-cert", "key_file": "--sink-key"}
        raise Usage(renamed(error, flags)) from None
    return files


def renamed(error: ValueError, names: dict[str, str]) -> str:
    """``error``'s text with its parameter names given as options (the words before the
    first quote: a file's name is never changed)."""
    head, quote, tail = str(error).partition("'")
    for name, flag in names.items():
        head = head.replace(name, flag)
    return head + quote + tail


def port(text: str) -> int:
    """An ``argparse`` type: a TCP port, 0..65535 (0 picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any free port): {text}")
    return value


def add_metrics_options(work: argparse.ArgumentParser) -> None:
    """``work``'s metrics flags."""
    work.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics while the "
        "run goes on, 0..65535 (0: any free port; the URL is printed on stderr; default: none)",
    )
    work.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (default 127.0.0.1; another needs --allow-remote)",
    )


def add_tls_files(parser: argparse.ArgumentParser, what: str) -> None:
    """``--tls-cert`` and ``--tls-key``: a sink's certificate and key."""
    add_files(
        parser,
        {
            "--tls-cert": f"{what}: this certificate (PEM, its chain after it)",
            "--tls-key": "its key (PEM)",
        },
    )


DB_WAIT_S = 300.0  # --db-wait-s's default


def add_db_wait(parser: argparse.ArgumentParser, what: str) -> None:
    """``--db-wait-s``: how long a starting ``what`` waits for its PostgreSQL server."""
    parser.add_argument(
        "--db-wait-s",
        type=within(float, 0, 86_400),
        default=DB_WAIT_S,
        metavar="S",
        help=f"a postgresql:// {what} whose server is down or starting is waited for, "
        f"trying again with backoff for up to S seconds (default {DB_WAIT_S:g}; 0: no wait)",
    )


def add_log_format(parser: argparse.ArgumentParser) -> None:
    """``--log-format``: how the command's log records reach stderr, one line each."""
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="each state change (started, paused and why, resumed, the database away and "
        "back, jobs ended dead, stopping, stopped) as one line on stderr, whether or not it "
        "is a terminal: 'text' (default) or 'json' (one object a line)",
    )


def log_to_stderr(args: argparse.Namespace, command: str) -> None:
    """The ``asnackq`` logger's records, one line each on stderr, as ``--log-format`` says."""
    logs.to_stderr(logging.getLogger("asnackq"), f"asnackq {command}", args.log_format)


def wait_for_database(where: Target, wait_s: float, command: str) -> None:
    """Return once a ``postgresql://`` server answers (a file: at once), saying on one line
    of stderr that ``asnackq COMMAND`` waits for it (``Unreachable`` after ``wait_s``)."""
    if not is_url(where):
        return
    from asnackq.store import pg

    def waiting(why: str) -> None:
        print(
            f"asnackq {command}: waiting for the database at {shown(where)} (up to "
            f"{wait_s:g} s): {why}",
            file=sys.stderr,
            flush=True,
        )

    pg.wait_until_reachable(str(where), wait_s, waiting)


async def ended(running: asyncio.Future[Any]) -> None:
    """``running`` ended (cancelled if it still runs) and its outcome read, so that a run
    left early by its caller neither outlives the queue it uses nor leaves its error unread
    (asyncio's "Task exception was never retrieved", with a traceback)."""
    running.cancel()
    await asyncio.wait([running])
    if not running.cancelled():
        running.exception()


@contextlib.contextmanager
def setting_up() -> Iterator[Callable[[], None]]:
    """While a run is set up, before ``stop_signals`` hands its signals to the run: each
    SIGINT or SIGTERM cancels the current task and is kept.  The function yielded raises
    ``KeyboardInterrupt`` (``interrupted``, exit 130) if one came: a stop whose cancellation
    something in the set-up took in (a Ctrl-C there was lost, and the run went on) is still
    a stop, never a run; as is a cancellation that ends the set-up (else asyncio.run's
    ``CancelledError``)."""
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    if task is None:
        raise RuntimeError("setting_up() is for a task")
    asked: list[int] = []

    def stop(signum: int) -> None:
        asked.append(signum)
        task.cancel()

    def go_on() -> None:
        if asked:
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signum)
    try:
        yield go_on
    except asyncio.CancelledError:
        if asked:
            raise KeyboardInterrupt from None
        raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


@contextlib.contextmanager
def stop_signals(task: asyncio.Future[Any]) -> Iterator[None]:
    """Each SIGINT or SIGTERM meanwhile cancels ``task`` (a run: the first stops it, the
    next end its grace, even two read at once: ``asnackq.aio.unshaken``)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, task.cancel)
    try:
        yield
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
