"""The command line keeps its word: every option's help says its range and default, every
command has a description, a URL with no port has its scheme's, and the output reads well
(plurals, ISO 8601 times)."""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import subprocess
from collections.abc import Iterator

import pytest

from asnackq.cli import parser
from asnackq.cli.render import iso, plural
from asnackq.lab import procs

from .test_cli import ok

RANGE = re.compile(r"\.\.|at most|up to|any int|>= ")


def options() -> Iterator[tuple[str, argparse.Action]]:
    def walk(command: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    assert sub.description, f"{path} {name} has no description"
                    yield from walk(sub, f"{path} {name}")
            elif action.option_strings and action.dest != "help":
                yield path, action

    yield from walk(parser(), "asnackq")


def test_every_option_says_what_it_does_its_range_and_its_default():
    seen = 0
    for path, action in options():
        name = f"{path} {action.option_strings[0]}"
        assert action.help, f"{name} has no help"
        takes_number = action.type is not None and getattr(action.type, "__name__", "") in (
            "parse",
            "exact_int",
            "port",
            "send_rate",
        )
        if takes_number:
            assert RANGE.search(action.help), f"{name}: no range in {action.help!r}"
        if action.default is not None and not isinstance(action.default, bool):
            assert "default" in action.help, f"{name}: no default in {action.help!r}"
        seen += 1
    assert seen > 100


@pytest.mark.process
def test_help_shows_the_ranges_and_defaults():
    for command in ("sink", "work", "lab", "enqueue", "demo", "dashboard", "audit"):
        shown = subprocess.run(
            procs.command(command, "--help"), capture_output=True, text=True, check=True
        ).stdout
        assert "usage: asnackq" in shown and shown.count("\n") > 5, command
    sink = subprocess.run(
        procs.command("sink", "--help"), capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"--delay-ms DELAY_MS\s+wait this long", sink)
    assert "0..60000; default 0" in " ".join(sink.split())


def test_plurals_and_iso_times():
    assert [plural(n, "job") for n in (0, 1, 2, 1000)] == [
        "0 jobs",
        "1 job",
        "2 jobs",
        "1,000 jobs",
    ]
    assert plural(1, "delivery", "deliveries") == "1 delivery"
    assert iso(1_796_315_520_000) == "2026-12-03T16:32:00Z"
    assert iso(None) is None and iso(10**20) == str(10**20)  # (out of range: as it is)


@pytest.mark.process
def test_init_history_and_redrive_read_well(tmp_path):
    queue = tmp_path / "q.db"
    ok("init", queue)
    ok("enqueue", queue, "--id", "a", "--qty", "1", "--ttl-ms", "1")
    assert "(1 job)" in ok("init", queue)
    subprocess.run(
        procs.command(
            "work", queue, "--sink", "http://127.0.0.1:9/e", "--until-empty", "--accept-dead"
        ),
        capture_output=True,
        check=True,
        timeout=120,
    )
    assert "redriven 1 job" in ok("redrive", queue, "a", "--ttl-ms", "60000", "--note", "again")
    history = ok("history", queue, "a")
    assert "1 redrive" in history and "redrives" not in history
    assert re.search(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", history), history
    assert ok("history", queue, "a", "--json")["redrives"][0]["at_ms"] > 0  # (JSON: as stored)


@contextlib.contextmanager
def port_80() -> Iterator[None]:
    """Skip unless 127.0.0.1:80 can be had (root, nothing there)."""
    with socket.socket() as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", 80))
        except OSError as error:
            pytest.skip(f"127.0.0.1:80 cannot be had here: {error}")
    yield


@pytest.mark.process
def test_a_url_with_no_port_has_its_schemes(tmp_path):
    """``http://127.0.0.1/events`` is port 80, for `work` (the async sender) and for
    `outbox dispatch` (the sync one) alike."""
    queue = tmp_path / "q.db"
    ok("init", queue)
    ok("enqueue", queue, "--id", "a", "--qty", "2")
    with port_80(), procs.Replicas(tmp_path / "sink.db", 1, "--port", "80") as sinks:
        assert sinks.urls[0] == "http://127.0.0.1:80/events"
        url = "http://127.0.0.1/events"
        done = ok("work", queue, "--sink", url, "--until-empty", "--json")
        assert done["done"] == 1
        source = tmp_path / "orders.db"
        ok("outbox", "accept", source, "--id", "o1", "--qty", "1")
        assert '"sent": ["o1"]' in ok("outbox", "dispatch", source, "--sink", url)
