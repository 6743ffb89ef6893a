"""Every command that takes a queue file takes a ``postgresql://`` URL; passwords stay hidden."""

from __future__ import annotations

import json
import re

import pytest

from asnackq.lab.pg_server import free_port
from asnackq.lab.procs import sink_process

from .pgdb import login, query
from .test_cli import asnackq, lines

SECRET = "hunter2-s3cret"


@pytest.fixture
def seen():
    """Every line any command printed, to look for the password afterwards."""
    outputs: list[str] = []
    yield outputs
    assert not [line for line in outputs if SECRET in line]


@pytest.fixture
def url(pg_pool, pg_db):
    return login(pg_pool, "tester", SECRET, pg_db())


def run(seen, *args, code=0, **kwargs):
    done = asnackq(*args, **kwargs)
    seen += [done.stdout, done.stderr]
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout) if "--json" in args and code == 0 else done


@pytest.mark.timeout(300)  # (every CLI command a process: on a busy machine, minutes)
def test_every_queue_command_takes_a_url(url, seen, tmp_path):
    shown = url.replace(SECRET, "***")
    assert run(seen, "init", url, "--json") == {"queue": shown, "created": True, "jobs": 0}
    assert run(seen, "init", url, "--json")["created"] is False
    assert (
        run(seen, "enqueue", url, "--id", "late", "--qty", "2", "--ttl-ms", "1", "--json")[
            "inserted"
        ]
        == 1
    )
    jobs = lines(*({"id": f"j{i}", "qty": i % 5 + 1} for i in range(300)))
    assert run(seen, "enqueue", url, "-", stdin=jobs, timeout=120).returncode == 0
    with sink_process(url) as one, sink_process(url) as two:  # the inbox in the same DB
        summaries = [
            run(
                seen,
                "work",
                url,
                "--sink",
                sink,
                "--until-empty",
                "--json",
                "--concurrency",
                "16",
                "--accept-dead",
                "--owner",
                f"w{n}",
            )
            for n, sink in enumerate((one, two))
        ]
    assert sum(s["done"] for s in summaries) == 300
    assert sum(s["dead_deadline"] for s in summaries) == 1
    stats = run(seen, "stats", url, "--json")
    assert stats["by_status"] == {"pending": 0, "leased": 0, "done": 300, "dead": 1}
    assert [d["id"] for d in run(seen, "dead", url, "--json")] == ["late"]
    assert (
        run(seen, "redrive", url, "late", "--ttl-ms", "60000", "--note", "again", "--json")[
            "redriven"
        ]
        == 1
    )
    history = run(seen, "history", url, "late", "--json")
    assert history["status"] == "pending" and history["redrives"][0]["note"] == "again"
    audit = run(seen, "audit", url, "--sink-db", url, "--json")
    assert audit["violations"] == 0 and audit["stages"] == {"done": 300, "queued": 1}
    assert audit["stock"] == sum(i % 5 + 1 for i in range(300))
    sink_file = tmp_path / "other-sink.db"
    run(seen, "audit", url, "--sink-db", sink_file, code=1)  # a missing file: one line
    assert "tester:***@127.0.0.1" in run(seen, "stats", url).stdout


def test_a_url_without_a_queue_a_server_down_and_a_refused_login_are_one_line(url, seen):
    for command in (
        ["stats", url],
        ["enqueue", url, "--id", "a", "--qty", "1"],
        ["work", url, "--sink", "http://127.0.0.1:9/events"],
    ):
        stderr = run(seen, *command, code=1).stderr
        assert stderr.count("\n") == 1 and "no queue at postgresql://tester:***@" in stderr
    assert query(url, "SELECT to_regclass('jobs')") == [(None,)]  # nothing created
    down = f"postgresql://tester:{SECRET}@127.0.0.1:{free_port()}/nothing"
    wrong = url.replace(SECRET, "not-the-password")
    for target, why in ((down, "refused"), (wrong, "password authentication failed")):
        for command in ("init", "stats", "dead"):
            stderr = run(seen, command, target, code=1).stderr
            assert stderr.count("\n") == 1 and why in stderr, stderr
            assert stderr.startswith(f"asnackq {command}: cannot connect to postgresql://")


@pytest.mark.parametrize("every_s", [0.01, 0.05])
def test_work_rides_out_sessions_terminated_from_its_first_moment(pg_db, tmp_path, every_s):
    """Every session of the queue's database is terminated every ``every_s`` from the moment
    ``asnackq work`` opens its first, for 1.5 s: through its first checks, its queue's opening and
    its first cycles.  It exits 0 with every job done once, and never says it lost the
    session as if that were the end of it."""
    import subprocess
    import threading
    import time

    import psycopg

    from asnackq.lab import procs

    url = pg_db()
    assert asnackq("init", url).returncode == 0
    jobs = lines(*({"id": f"j{i}", "qty": 1} for i in range(30)))
    assert asnackq("enqueue", url, "-", stdin=jobs, timeout=120).returncode == 0
    database = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    stop, killed = threading.Event(), []

    def terminate() -> None:
        with psycopg.connect(url, autocommit=True) as con:
            # From the worker's first session on (a start takes seconds on a busy machine).
            first = time.monotonic() + 60
            while time.monotonic() < first and not stop.is_set():
                ((n,),) = con.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (database,),
                ).fetchall()
                if n:
                    break
                stop.wait(0.005)
            ends = time.monotonic() + 1.5
            while time.monotonic() < ends and not stop.is_set():
                ((n,),) = con.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (database,),
                ).fetchall()
                killed.append(n)
                stop.wait(every_s)

    with sink_process(tmp_path / "sink.db") as sink:
        work = subprocess.Popen(
            procs.command("work", url, "--sink", sink, "--until-empty"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        killer = threading.Thread(target=terminate)
        killer.start()
        try:
            _, err = work.communicate(timeout=120)
        finally:
            stop.set()
            killer.join()
    assert work.returncode == 0, err
    assert all(line.startswith("asnackq work: ") for line in err.splitlines()), err
    assert sum(killed) >= 1  # (sessions were there to terminate)
    assert query(url, "SELECT status, count(*) FROM jobs GROUP BY 1") == [("done", 30)]


@pytest.mark.parametrize("password", ["hu?nt#er2-x", "a#b?c&password=d", "q?#"])
def test_a_password_holding_query_and_fragment_characters_is_never_shown(
    pg_pool, pg_db, tmp_path, password
):
    """libpq takes '?' and '#' in a URL's password (up to the '@'); every command that
    names the queue shows it as ***, on success and on error, and never a piece of it."""
    url = login(pg_pool, "tester", password, pg_db())
    outputs: list[str] = []
    run(outputs, "init", url, "--json")
    run(outputs, "enqueue", url, "--id", "a", "--qty", "1")
    run(outputs, "stats", url)
    run(outputs, "stats", url, "--json")
    run(outputs, "dead", url, "--json")
    run(outputs, "history", url, "zz", code=1)
    run(outputs, "audit", url, "--sink-db", tmp_path / "none.db", code=1)
    down = url.replace(url.split("@")[1].split("/")[0], f"127.0.0.1:{free_port()}")
    run(outputs, "stats", down, code=1)
    printed = "".join(outputs)
    assert "tester:***@" in printed
    pieces = [piece for piece in re.split(r"[?#&]", password) if len(piece) > 2]
    assert password not in printed and not [p for p in pieces if p in printed], pieces
