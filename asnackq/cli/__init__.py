"""The ``asnackq`` command: one entry point, one subcommand per job.

Exit codes: 0 ok, 1 failure or violation, 2 usage (an unknown, missing, malformed or
out-of-range option, or options that do not go together), 130 interrupted (Ctrl-C).  A bad
input is one clear line on stderr (never a traceback) and changes nothing: options are
checked before any file is opened or created.
"""

from __future__ import annotations

import argparse
import logging
import sqlite3
import sys
from collections.abc import Sequence

from asnackq.cli import lifeline, otel
from asnackq.cli.common import Command, Failure, Parser, Usage, complete_help
from asnackq.cli.endpoints import add_endpoint
from asnackq.cli.enqueue import add_enqueue
from asnackq.cli.lab import add_demo, add_lab
from asnackq.cli.purge import add_purge
from asnackq.cli.queue import add_audit, add_init, add_inspect
from asnackq.cli.serve import add_dashboard, add_outbox, add_sink
from asnackq.cli.work import add_work
from asnackq.core import worker as w
from asnackq.store.outage import database_error
from asnackq.store.sessions import LOG as STORE_LOG
from asnackq.store.targets import one_line
from asnackq.wire import logs

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="asnackq", description="At-least-once delivery with once-only effects.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo(commands)
    add_init(commands)
    add_enqueue(commands)
    add_work(commands)
    add_inspect(commands)
    add_audit(commands)
    add_purge(commands)
    add_endpoint(commands)
    add_lab(commands)
    add_sink(commands)
    add_outbox(commands)
    add_dashboard(commands)
    complete_help(top)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asnackq`` command; return its exit code."""
    lifeline.end_with_parent()  # (started by the lab: end with it)
    try:
        args = parser().parse_args(argv)  # (its commands' modules imported: a while)
    except KeyboardInterrupt:  # (Ctrl-C before any command ran: nothing was done)
        print("asnackq: interrupted", file=sys.stderr)
        return 130
    run: Command = args.run
    # A file another program holds is waited for, said in one line (``store.sessions``).
    logs.to_stderr(STORE_LOG, f"asnackq {args.command}", getattr(args, "log_format", "text"))
    # psycopg's warnings on cleaning up after a lost session (several lines each) say what
    # the command's own lines say once: the database is away.
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    try:
        with otel.exporting(args, f"asnackq-{args.command}"):  # (tracing, when asked for)
            return run(args)
    except Failure as error:
        print(f"asnackq {args.command}: {error}", file=sys.stderr)
        return 2 if isinstance(error, Usage) else 1
    except KeyboardInterrupt:  # Ctrl-C: the children were stopped on the way
        print(f"asnackq {args.command}: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, sqlite3.Error, w.Conflict) as error:
        print(f"asnackq {args.command}: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if not database_error(error):
            raise
        print(f"asnackq {args.command}: database error: {one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
