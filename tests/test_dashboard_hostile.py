"""``asnackq dashboard`` against hostile clients (raw sockets), locked files and PostgreSQL:
a 401 for any credential it cannot match, one log line per malformed request, a lock shown
and outlived at once, a URL's password never shown."""

from __future__ import annotations

import base64
import contextlib
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from asnackq.lab import procs
from asnackq.lab.procs import PIPE, sink_process
from asnackq.wire.send import HttpSender

from . import test_dashboard
from .pgdb import login
from .test_cli import asnackq
from .test_dashboard import request, state, until

dbs = test_dashboard.dbs  # the fixture: a queue with a job in every state, and a sink DB


@contextlib.contextmanager
def dashboard(*args, log):
    """A dashboard process writing stderr to ``log``; its base URL; stopped by SIGTERM."""
    with open(log, "w") as stderr:
        proc = procs.start(procs.command("dashboard", *args), stdout=PIPE, stderr=stderr)
        try:
            line = proc.stdout.readline()
            assert line.startswith("asnackq dashboard listening on http://127.0.0.1:"), line
            yield line.split()[-1]
        finally:
            code = procs.stop(proc)[0]
    assert code == 0
    assert "Traceback" not in log.read_text()


def raw(url, data):
    """Raw bytes on a new connection; the status line of the answer (b"" without one)."""
    port = urllib.parse.urlsplit(url).port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                reply += chunk
    return reply.partition(b"\r\n")[0]


def get(path=b"/api/state", *headers):
    lines = [b"GET " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.mark.process
def test_a_credential_with_any_other_byte_is_a_401(dbs, tmp_path):
    queue, _ = dbs
    with dashboard(queue, "--auth-token", "s3cret", log=tmp_path / "log") as url:
        for header in (
            b"Authorization: Bearer \xff",
            b"Authorization: Bearer s3cr\xe9t",
            b"Authorization: Basic \xff\xfe",
            b"Authorization: Basic " + base64.b64encode("u:s3cr\u00e9t".encode()),
            b"Authorization: Basic " + base64.b64encode(b"u:\xff\xfe"),
            b"Authorization: \x80",
        ):
            for path in (b"/", b"/api/state", b"/metrics", b"/nope"):
                assert raw(url, get(path, header)) == b"HTTP/1.1 401 Unauthorized", header
        assert raw(url, get(b"/api/state", b"Authorization: Bearer s3cret")).endswith(b" 200 OK")
    assert (tmp_path / "log").read_text() == ""


@pytest.mark.process
def test_malformed_requests_are_one_log_line_each_at_most(dbs, tmp_path):
    queue, _ = dbs
    bad = [
        get(b"/", b"Host: evil"),  # a duplicate Host
        get(b"/", b"X-A: a\x00b"),
        get(b"/", b"X-A: a\rb"),
        get(b"/\x00"),
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(256)),  # TLS hello
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /" + b"x" * 20_000 + b" HTTP/1.1\r\n\r\n",
    ]
    log = tmp_path / "log"
    with dashboard(queue, log=log) as url:
        for data in bad * 3:
            assert raw(url, data)[:12] in (b"HTTP/1.0 400", b"HTTP/1.1 400", b""), data[:40]
        for expect in (b"Expect: \xff", b"Expect: bogus", b"Expect: 100-continue\xff"):
            for path in (b"/", b"/api/state", b"/nope"):
                assert raw(url, get(path, expect)) == b"HTTP/1.1 417 Expectation Failed"
        assert state(url)["error"] is None  # still serving
    lines = log.read_text().splitlines()
    assert len(lines) <= len(bad) * 3
    assert all(line.startswith("asnackq dashboard: ") and line.isascii() for line in lines)
    assert all(len(line) <= 420 for line in lines)


LOCKER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
con.execute("COMMIT")
"""


@contextlib.contextmanager
def locked(path):
    """``path`` held under an exclusive lock by another process until the block ends."""
    command = [sys.executable, "-c", LOCKER, str(path)]
    with subprocess.Popen(command, stdin=PIPE, stdout=PIPE, text=True) as locker:
        try:
            assert locker.stdout.readline() == "locked\n"
            yield
        finally:
            locker.stdin.close()
            assert locker.wait(timeout=30) == 0


@pytest.mark.process
def test_a_lock_is_shown_and_the_page_is_fresh_right_after_it(dbs, tmp_path):
    queue, sink = dbs
    with dashboard(queue, "--sink-db", sink, log=tmp_path / "log") as url:
        for path in (queue, sink):
            with locked(path):
                shown = until(lambda: (seen := state(url))["error"] and seen, timeout=5)
                assert "is locked by another process" in shown["error"]
                assert shown["stats"]["by_status"]["pending"] == 2  # the last figures stay
                time.sleep(3)  # a lock held for a while: no sample may scale by it
            unlocked = time.monotonic()
            until(lambda: state(url)["error"] is None, timeout=5)
            assert time.monotonic() - unlocked < 2.5
            later = state(url)["at_ms"]
            until(lambda later=later: state(url)["at_ms"] > later, timeout=3)  # every second


SECRET = "dash-s3cret-pw"


def test_it_reads_postgresql_and_never_shows_the_password(pg_pool, pg_db, tmp_path):
    url = login(pg_pool, "dashboarder", SECRET, pg_db())
    outputs = []
    for args in (("init", url), ("enqueue", url, "--id", "a", "--qty", "3")):
        done = asnackq(*args)
        outputs += [done.stdout, done.stderr]
        assert done.returncode == 0, done.stderr
    with sink_process(url) as sink:  # the inbox in the same database
        assert HttpSender(sink)({"id": "a", "qty": 3}) is True
    log = tmp_path / "log"
    with dashboard(url, "--sink-db", url, log=log) as base:
        shown = state(base)
        metrics = request(base, "/metrics")[2].decode()
    outputs += [log.read_text(), str(shown), metrics]
    assert shown["error"] is None and shown["queue"] == url.replace(SECRET, "***")
    assert shown["stats"]["by_status"]["pending"] == 1
    assert shown["inbox"] == {"effects_applied": 1, "deliveries": 1, "duplicates": 0, "stock": 3}
    assert [e["id"] for e in shown["audit"]["attention"]] == ["a"]  # applied, not yet done
    wrong = url.replace(SECRET, "not-" + SECRET)
    for args in ((wrong,), (url, "--sink-db", wrong), (url + "-missing",)):
        done = asnackq("dashboard", *args)
        outputs += [done.stdout, done.stderr]
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr
    assert not [text for text in outputs if SECRET in text]
